"""DeepSeek-V3 architecture (MLA) on the paged latent cache: a tiny random model, built offline.

Checks: greedy tokens with the bf16 pagedkv latent cache == transformers' own cache; logits vs
eager attention (exactly, when eager sees the same bf16-rounded latents; within the bf16 error
otherwise); chunked prefill == one-shot prefill; per-latent bytes; plan arithmetic."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from helpers.mla import LAT, LAYERS, ROPE, RoundingCache as _RoundingCache  # noqa: E402
from helpers.mla import mla_config as _config, random_ids as _ids  # noqa: E402
from pagedkv.errors import ConfigError, InvalidInput  # noqa: E402
from pagedkv.integrations.deepseek import PagedLatentCache, disable, enable, mla_dims  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(_config()).eval()
    yield m
    disable(m)


@torch.no_grad()
def test_greedy_tokens_match_transformers_cache(model):
    ids = _ids()
    disable(model)
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=0)
    enable(model)
    cache = PagedLatentCache(model, "bf16")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=12,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == ids.shape[1] + 11
    # bytes are per latent: (512-style) latent + rope per token and layer, bf16
    assert cache.bytes_per_token() == LAYERS * (LAT + ROPE) * 2


@torch.no_grad()
def test_logits_match_eager_attention(model):
    full = _ids(seed=2, n=20)
    disable(model)
    eager = model(full).logits
    rounded = model(full, cache=_RoundingCache(config=model.config)).logits
    enable(model)
    assert enable(model) == LAYERS  # idempotent; other caches still run transformers' own forward
    torch.testing.assert_close(model(full, cache=_RoundingCache(config=model.config)).logits, rounded,
                               atol=0, rtol=0)
    ours = model(full, cache=PagedLatentCache(model, "bf16")).logits
    # same stored values -> only fp32 summation order differs (absorbed vs expanded heads)
    torch.testing.assert_close(ours, rounded, atol=2e-3 * float(eager.abs().max()), rtol=0)
    # vs exact eager: the bf16 rounding of the latent (rel 2^-9) is the only loss; it propagates
    # through LAYERS layers of this deliberately high-gain random model (init std 0.2)
    err = float((ours - eager).abs().max()) / float(eager.abs().max())
    assert err < 0.03
    # chunked prefill (7 + 8 tokens) then decode steps == one-shot prefill
    cache = PagedLatentCache(model, "bf16", block_size=4)
    parts = [model(full[:, a:b], cache=cache).logits for a, b in ((0, 7), (7, 15), (15, 16), (16, 17))]
    torch.testing.assert_close(torch.cat(parts, 1), ours[:, :17], atol=2e-3 * float(eager.abs().max()),
                               rtol=0)


@torch.no_grad()
def test_compressed_formats_run_and_rank_by_precision(model):
    full = _ids(seed=3, batch=1, n=24)
    disable(model)
    eager = model(full).logits
    enable(model)
    errs = {}
    for fmt in ("turbo8", "q4_0", "fp8"):
        cache = PagedLatentCache(model, fmt, high_precision_layers=0)
        errs[fmt] = float((model(full, cache=cache).logits - eager).abs().mean())
        assert cache.layers[0].spec.latent.latent_codec.name == fmt
    assert cache.layers[0].spec.latent.name == "fp8+q8_0rope"  # rope "auto", by measurement
    assert errs["turbo8"] < errs["q4_0"]


@torch.no_grad()
def test_misuse_raises(model):
    disable(model)
    with pytest.raises(InvalidInput, match="enable"):
        model(_ids(), cache=PagedLatentCache(model, "bf16"))
    enable(model)
    with pytest.raises(ConfigError, match="latent"):
        PagedLatentCache(transformers.LlamaConfig(num_hidden_layers=1), "bf16")
    # padded batches are supported (tests/test_deepseek_padding.py); a mask that is not causal
    # + padding is refused
    with pytest.raises(InvalidInput, match="causal"):
        model(_ids(), attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool),
              cache=PagedLatentCache(model, "bf16"))


def test_plan_counts_latent_bytes_per_token():
    from pagedkv.eval.plan import plan

    cfg = DeepseekV3Config()  # DeepSeek-V3: 61 layers, 512 latent + 64 rope, 128 heads
    assert mla_dims(cfg) == (512, 64)
    rows = {r["format"]: r for r in plan(cfg, 80 << 30, ["bf16", "fp8", "turbo4+hp"], seq_len=32768)}
    assert rows["bf16"]["bytes_per_token"] == 61 * 576 * 2
    assert rows["fp8"]["bytes_per_token"] == 61 * (512 + 64 + 4)  # q8_0 rope: 64 B + 2 fp16 scales
    assert rows["bf16"]["tokens"] == (80 << 30) // (61 * 576 * 2 * 16) * 16
    assert rows["bf16"]["bits_per_element"] == 16
    hp = rows["turbo4+hp"]["high_precision_layers"]
    assert hp == 2
    # hp layers in q8_0 (576 x 8.5 bits = 612 B), the others turbo4 latent + rope
    assert rows["turbo4+hp"]["bytes_per_token"] == 2 * hp * 612 + (61 - 2 * hp) * (288 + 36)


@torch.no_grad()
def test_beam_search_matches_transformers_cache(model):
    ids = _ids(seed=4, batch=1, n=10)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, num_beams=3,
              pad_token_id=0)
    disable(model)
    ref = model.generate(ids, **kw)
    enable(model)
    out = model.generate(ids, cache=PagedLatentCache(model, "bf16", block_size=4), **kw)
    assert torch.equal(out, ref)


def test_kv_cache_refuses_mla_and_eval_runs_latent(model):
    from pagedkv.eval.runner import EvalConfig, evaluate
    from pagedkv.integrations.transformers import PagedKVCache

    with pytest.raises(ConfigError, match="PagedLatentCache"):
        PagedKVCache(model.config, "bf16")
    window = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(5))
    rows = evaluate(model, [window], EvalConfig(formats=("bf16", "turbo8"), windows=1, window_tokens=16,
                                                decode_steps=0))
    by = {r["format"]: r for r in rows}
    assert by["bf16"]["bytes_per_token"] == LAYERS * (LAT + ROPE) * 2
    assert by["bf16"]["bits_per_element"] == 16 and by["bf16"]["kl"] == 0
    assert by["turbo8"]["kl"] > 0


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 1.0,
        "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0}


@pytest.mark.parametrize("variant", [dict(q_lora_rank=None), dict(rope_interleave=False),
                                     dict(rope_parameters=YARN)], ids=["q_proj", "rope_half", "yarn_mscale"])
@torch.no_grad()
def test_config_variants_match_eager(variant):
    """DeepSeek-V2-Lite style q_proj, half-split RoPE, YaRN (its mscale changes the softmax scale)."""
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(_config(num_hidden_layers=2, **variant)).eval()
    full = _ids(seed=2, n=20)
    rounded = m(full, cache=_RoundingCache(config=m.config)).logits
    enable(m)
    ours = m(full, cache=PagedLatentCache(m, "bf16")).logits
    torch.testing.assert_close(ours, rounded, atol=1e-4 * float(rounded.abs().max()), rtol=0)


@torch.no_grad()
def test_bf16_model_greedy_tokens_match_transformers_cache():
    """A bf16 model: absorption runs in bf16 like transformers' projections, attention in fp32."""
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(_config(initializer_range=0.05)).eval().to(torch.bfloat16)
    ids = _ids(seed=1)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    ref = m.generate(ids, **kw)
    enable(m)
    out = m.generate(ids, cache=PagedLatentCache(m, "bf16"), **kw)
    assert torch.equal(out, ref)
