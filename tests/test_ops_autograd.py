"""The ops are inference ops: outside `torch.no_grad()` (a notebook's plain `model(ids, ...)`),
with inputs that require grad, every backend gives the same bytes and outputs as under no_grad,
and returns tensors that carry no graph."""

from __future__ import annotations

import pytest
import torch

from pagedkv.codecs import CODECS
from pagedkv.ops import AttentionParams, decode_attention, make_layer, prefill_attention, store
from pagedkv.ops.dispatch import backends

P = AttentionParams(scale=0.125)


def _run(backend: str, grad: bool):
    torch.manual_seed(0)
    layer = make_layer(CODECS["turbo3"], CODECS["fp8"], 4, 16, 2, 64, k_scale=1.0, v_scale=1.0)
    k, v, q = torch.randn(40, 2, 64), torch.randn(40, 2, 64), torch.randn(40, 4, 64)
    if grad:
        k, v, q = (t.requires_grad_() for t in (k, v, q))
    store(layer, k, v, torch.arange(40), backend=backend)
    tables = torch.arange(4, dtype=torch.int32)[None]
    lens = torch.tensor([40], dtype=torch.int32)
    qsl = torch.tensor([0, 40], dtype=torch.int32)
    pre = prefill_attention(q, layer, tables, lens, qsl, P, backend=backend)
    dec = decode_attention(q[-1:], layer, tables, lens, P, backend=backend)
    return layer, pre, dec


@pytest.mark.parametrize("backend", [b.name for b in backends("cpu")])
def test_ops_outside_no_grad_match_no_grad(backend):
    with torch.no_grad():
        want_layer, want_pre, want_dec = _run(backend, grad=False)
    layer, pre, dec = _run(backend, grad=True)
    assert torch.equal(layer.k_pool, want_layer.k_pool) and torch.equal(layer.v_pool, want_layer.v_pool)
    assert torch.equal(pre, want_pre) and torch.equal(dec, want_dec)
    assert not pre.requires_grad and not dec.requires_grad


@pytest.mark.model
def test_drop_in_forward_outside_no_grad():
    pytest.importorskip("gguf")
    from helpers.embedded import embedded_lm

    from pagedkv.integrations.transformers import PagedKVCache, enable

    lm = embedded_lm()
    tok, model = lm.tokenizer, lm.model
    enable(model)
    ids = tok("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model(ids, cache=PagedKVCache(model, "turbo3"), use_cache=True).logits
    cache = PagedKVCache(model, "turbo3")
    got = model(ids, cache=cache, use_cache=True).logits  # grad mode on, as in a notebook
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
