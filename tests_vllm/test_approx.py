"""The approximate attention paths as a vLLM setting (`{"pagedkv": {"approx": ...}}`, the same text
as `PagedKVCache(approx=...)` and `pagedkv eval --approx`): every attention layer's calls carry
it, and the engine serves with it. The paths' error bounds are the main suite's kernel tests."""

from engine import engine, greedy
from workloads import FIRST_TOKENS, PROMPTS


def test_approx_reaches_every_layer_and_the_engine_serves():
    with engine({"kv_format": "turbo3", "approx": "int8_scores"}) as llm:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        impls = [m.impl for m in ctx.values() if hasattr(m, "impl")]
        assert len(impls) == 30
        params = [i._attention_params() for i in impls]
        assert all(p.int8_scores and not p.bf16_dots and p.sparse_v_threshold == 0 for p in params)
        (ids, text, _), = greedy(llm, PROMPTS[:1], FIRST_TOKENS)
        assert len(ids) == FIRST_TOKENS and text.strip()
