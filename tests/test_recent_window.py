"""The high-precision recent window in the transformers drop-in and the eval.

Oracles: (1) token-by-token decoding with the same recent window (what the eval's one pass
must reproduce: query p sees (p - R, p] from the tail, the rest compressed); (2) R >= the whole
sequence with a bf16 tail is the bf16 cache; (3) the window helps: closer to bf16 than the
format alone.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.eval.runner import parse_choice  # noqa: E402
from pagedkv.integrations.transformers import ATTN_IMPLEMENTATION, PagedKVCache, register  # noqa: E402
from pagedkv.ops.recent import RecentWindow  # noqa: E402

VOCAB, N = 96, 40


def _model(family="llama"):
    register()
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
    if family == "gemma2":
        cfg = transformers.Gemma2Config(**common, sliding_window=8, attn_logit_softcapping=20.0,
                                        final_logit_softcapping=30.0, query_pre_attn_scalar=32)
        model = transformers.Gemma2ForCausalLM(cfg).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def _ids():
    return torch.randint(3, VOCAB, (1, N), generator=torch.Generator().manual_seed(1))


def _run(model, fmt, recent, ids, chunks=(N,), **kw):
    cache = PagedKVCache(model, fmt, high_precision_layers=0, block_size=4, recent_window=recent, **kw)
    outs, at = [], 0
    with torch.no_grad():
        for c in chunks:
            outs.append(model(ids[:, at:at + c], cache=cache, use_cache=True).logits.float())
            at += c
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("recent", [RecentWindow(6), RecentWindow(9, "q8_0")])
def test_one_pass_equals_token_by_token_decoding(family, recent):
    model, ids = _model(family), _ids()
    fixed = dict(key_centring=False, value_centring=False)  # statistics of the first chunk differ
    one, _ = _run(model, "turbo2", recent, ids, **fixed)
    steps, _ = _run(model, "turbo2", recent, ids, chunks=(5,) + (1,) * (N - 5), **fixed)
    assert (one - steps).abs().max() < 1e-3 * one.abs().max()


def test_limits_and_that_the_window_helps():
    model, ids = _model(), _ids()
    exact, _ = _run(model, "bf16", None, ids)
    fixed = dict(key_centring=False, value_centring=False)  # then the bf16 tail stores bf16(k)
    whole, cache = _run(model, "turbo2", RecentWindow(N), ids, **fixed)
    assert (whole - exact).abs().max() < 1e-4 * exact.abs().max()
    plain, _ = _run(model, "turbo2", None, ids)
    near, _ = _run(model, "turbo2", 8, ids)
    err = lambda x: float((x - exact).abs().mean())  # noqa: E731
    assert err(near) < 0.8 * err(plain)
    assert cache.pool_bytes() > _run(model, "turbo2", None, ids)[1].pool_bytes()  # the tail is held


def test_bad_settings_and_eval_labels():
    model = _model()
    with pytest.raises(ConfigError, match="recent_window must be"):
        PagedKVCache(model, "turbo3", recent_window="64")
    with pytest.raises(ConfigError, match="needs a tensor scale"):
        RecentWindow(8, "fp8")
    c = parse_choice("turbo3+hp+r64q8_0")
    assert c.label == "turbo3+hp+r64q8_0" and c.recent == RecentWindow(64, "q8_0")
    assert c.high_precision_layers == "auto"
    assert parse_choice("turbo4+r32").recent == RecentWindow(32)
