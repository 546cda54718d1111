"""A per-layer plan file (`pagedkv tune`'s plan.json) as the vLLM format: every layer gets the
plan's codecs, vLLM's capacity is the plan's bytes, the engine generates, and its quality sits
where its codecs put it (between bf16 and turbo3+hp). A plan made for another model fails at
engine start naming the reason; a plan with a recent window gets its tails."""

import pytest

from engine import KV_BYTES, coarse_kl
from test_refusals import LLAMA, _start, _tiny
from workloads import plan_layers, write_plan


def test_every_layer_serves_the_plans_codecs(runs):
    from pagedkv.formats import KVFormat
    from pagedkv.codecs import get_codec

    want = [KVFormat(get_codec(k), get_codec(v)).name for k, v in plan_layers()]
    assert runs["plan"]["formats"] == want


def test_reported_capacity_is_the_plans_bytes(runs, plan_path):
    from pagedkv.formats import read_plan
    from pagedkv.integrations.vllm.layout import page_bytes

    per_block = sum(page_bytes(f, 128, 3, 64) for f in read_plan(plan_path, [(3, 64)] * 30)["formats"])
    blocks, tokens = runs["plan"]["capacity"]
    assert blocks == KV_BYTES // per_block and tokens == blocks * 128
    assert blocks > runs["bf16"]["capacity"][0] * 3  # ~4.3 bits per element against 16


def test_the_plan_generates_with_quality_between_bf16_and_turbo3(runs):
    (ids, text, _), = runs["plan"]["greedy"]
    assert len(ids) > 0 and text.strip()
    kl = coarse_kl(runs["bf16"]["logprobs"], runs["plan"]["logprobs"])
    kl3 = coarse_kl(runs["bf16"]["logprobs"], runs["turbo3"]["logprobs"])
    print(f"MEASURED plan: vLLM prompt-logprob KL {kl:.5f} (turbo3+hp {kl3:.5f})")
    assert 0 < kl < kl3  # turbo4 keys in 27 layers where turbo3+hp has turbo3 keys in 24


def test_a_plan_for_another_model_is_refused_at_start(tmp_path):
    path = write_plan(tmp_path / "p30.json", plan_layers(30), dims=(2, 32))
    with pytest.raises(Exception, match="p30.json.*made for 30 layers"):
        _start(_tiny(tmp_path, "llama", dict(LLAMA, hidden_size=128, head_dim=32)), {"kv_format": path})


def test_a_plan_with_a_recent_window_gets_a_tail_per_layer(tmp_path):
    """A plan made with a window (`pagedkv tune --recent 64q8_0`): every layer keeps a tail in
    a second KV-cache group (vLLM's sliding window of 64 tokens), and the engine generates."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine import engine
    from pagedkv.integrations.vllm.tail import TailLayer

    path = write_plan(tmp_path / "pr.json", plan_layers(2), dims=(2, 32), recent=(64, "q8_0"))
    model = _tiny(tmp_path, "llama", dict(LLAMA, hidden_size=128, head_dim=32))
    with engine({"kv_format": path, "key_centring": False, "value_centring": False}, model=model,
                load_format="dummy", skip_tokenizer_init=True, max_model_len=256) as llm:
        ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        tails = {n: m for n, m in ctx.items() if isinstance(m, TailLayer)}
        assert sorted(tails) == [f"model.layers.{i}.self_attn.attn.pagedkv_tail" for i in range(2)]
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
        specs = {n: g.kv_cache_spec for g in groups for n in g.layer_names}
        for name in tails:  # vLLM may split the tails over groups: each a sliding window of 64
            spec = getattr(specs[name], "kv_cache_specs", {name: specs[name]})[name]
            assert type(spec).__name__ == "SlidingWindowSpec" and spec.sliding_window == 64, spec
        out = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 150)))],
                           SamplingParams(max_tokens=8, temperature=0.0, detokenize=False), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
