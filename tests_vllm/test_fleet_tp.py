"""pagedkv pages under tensor parallelism on vLLM's CPU backend, with the KV connector.

The embedded SmolLM2 has 3 KV heads, which vLLM cannot split over 2 ranks; `tp_model.py` cuts it
to 2 KV heads (6 query heads, trained weights). The same prompt is served by the cut model with
tensor_parallel_size=1 and with tensor_parallel_size=2 (two worker processes, one core each,
VLLM_CPU_OMP_THREADS_BIND=0|1), both with turbo3+hp pages and the connector on a disk store.

OPEN (xfail, strict): TP=2 does not match TP=1 yet. vLLM's own cache on this model gives a
prompt-logprob KL(TP=1 || TP=2) of 7.5e-11, pagedkv's turbo3+hp pages 4.1e-2 and 7.0e-3 in two
runs of this test (the second with equal greedy tokens; 1.7e-2 with
centring off, so not the per-rank statistics alone; 1 vs 2 threads: bit-identical, so not the
thread count; TP=1 on the uni and the mp executor: bit-identical; the ops themselves split
exactly: one layer of 2 KV heads and 6 query heads gives the same outputs, bit for bit, as two
layers of one KV head and its 3 query heads): the size of the format's own error (0.0465
against bf16 pages on SmolLM2), as if the two runs quantized different data. The test asks for a tenth of that; it fails until the
cause is found. Not strict: the KL varied 6x between two runs, so a run could pass by chance, and
a strict XPASS would then fail the suite; the measured KL is printed (`-s`), and the mark goes
with the fix.
The connector under TP: each rank publishes its own
pages under its own keys (twice the records), and the TP=2 engine, its prefix cache emptied,
loads both ranks' pages back and generates the same tokens as from its own computation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine import coarse_kl, model_dir
from tp_model import write_tp_model
from workloads import prefix_prompt

HERE = os.path.dirname(os.path.abspath(__file__))
FORMAT = {"kv_format": "turbo3+hp"}
SHARED_BLOCKS = 4
KL_TOLERANCE = 0.0465 / 10  # a tenth of turbo3+hp's own KL against bf16 pages (see the docstring)


def _logprobs(result):
    return [[{int(t): v for t, v in pos.items()} for pos in w] for w in result["logprobs"]]


def _instance(tmp_path, name: str, spec: dict, env: dict) -> list:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, os.path.join(HERE, "fleet_instance.py"), str(path)],
                         capture_output=True, text=True, timeout=1800, env=dict(os.environ, **env))
    assert out.returncode == 0, f"instance {name}:\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])["results"]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("tp")
    model = write_tp_model(model_dir(), str(tmp / "model"))
    ids = AutoTokenizer.from_pretrained(model)(prefix_prompt())["input_ids"]
    gen = {"prompts": [ids], "max_tokens": 8}
    lps = {"prompts": [ids[:320]], "logprobs": 5}
    one = _instance(tmp, "tp1", {"pagedkv": FORMAT, "store": {"path": str(tmp / "store1")},
                                 "engine": {"model": model}, "steps": [gen, lps]}, {})
    two = _instance(tmp, "tp2", {"pagedkv": FORMAT, "store": {"path": str(tmp / "store2")},
                                 "engine": {"model": model, "tensor_parallel_size": 2,
                                            "distributed_executor_backend": "mp"},
                                 "steps": [gen, {"reset": True}, gen, lps]},
                    {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    stored = sum(f.startswith("pkv") for _, _, files in os.walk(tmp / "store2") for f in files)
    return one, two, stored


@pytest.mark.xfail(strict=False, reason="open: pagedkv pages under TP=2 differ from TP=1 (KL 4e-2, vLLM's "
                   "own cache 7.5e-11); see the module docstring")
def test_tensor_parallel_2_matches_one_rank(tp_runs):
    one, two, _ = tp_runs
    kl = coarse_kl(_logprobs(one[1]), _logprobs(two[2]))
    print(f"MEASURED TP=2 vs TP=1 prompt-logprob KL {kl:.2e}; greedy tokens {one[0]['tokens']} / {two[0]['tokens']}")
    assert kl < KL_TOLERANCE
    assert two[0]["tokens"][0][0] == one[0]["tokens"][0][0]


def test_each_rank_publishes_and_loads_its_own_pages(tp_runs):
    _, two, stored = tp_runs
    assert two[0]["cached"] == [0]
    assert stored == 2 * SHARED_BLOCKS  # one record per rank and block
    hit = two[1]  # after the reset
    assert hit["stats"]["scheduler"]["hit_blocks"] == SHARED_BLOCKS  # found under both ranks' keys
    assert hit["cached"] == [SHARED_BLOCKS * 128]
    assert hit["tokens"] == two[0]["tokens"]
