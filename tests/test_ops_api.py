"""Public ops: validation (clear errors before any write), dispatch, store byte layout."""

from __future__ import annotations

import pytest
import torch

from pagedkv.codecs import CODECS
from pagedkv.codecs import reference as codec_ref
from pagedkv.codecs.layout import block_views
from pagedkv.errors import ConfigError, InvalidInput
from pagedkv.ops import (AttentionParams, Backend, Op, decode_attention, get_backend, make_layer,
                         prefill_attention, register_backend, select_backend, store)
from pagedkv.ops import dispatch, reference

P = AttentionParams(scale=0.125)


def _layer(k="turbo3", v="turbo4", blocks=4, bs=16, h=2, d=64, **kw):
    return make_layer(CODECS[k], CODECS[v], blocks, bs, h, d, **kw)


def _filled(k="turbo3", v="turbo4"):
    layer = _layer(k, v)
    torch.manual_seed(0)
    store(layer, torch.randn(20, 2, 64), torch.randn(20, 2, 64), torch.arange(20), backend="reference")
    return layer


# ---- store ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k,v", [("turbo3", "fp8"), ("bf16", "q4_0"), ("nvfp4", "turbo8")])
def test_store_writes_encoded_rows_at_their_slots(k, v):
    layer = _layer(k, v, k_scale=0.5, v_scale=2.0)
    torch.manual_seed(1)
    kx, vx = torch.randn(5, 2, 64), torch.randn(5, 2, 64)
    slots = torch.tensor([17, -1, 3, 40, -5])
    store(layer, kx, vx, slots, backend="reference")
    for side, x, codec, pool, scale in (("k", kx, layer.k_codec, layer.k_pool, 0.5), ("v", vx, layer.v_codec, layer.v_pool, 2.0)):
        data, scales = block_views(codec, pool, 16, 2, 64)
        want_d, want_s = codec_ref.encode(codec, x, scale if codec.name == "fp8" else None)
        for t, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            assert torch.equal(data[slot // 16, slot % 16], want_d[t]), (side, slot)
            assert torch.equal(scales[slot // 16, slot % 16], want_s[t]), (side, slot)
        written = {s for s in slots.tolist() if s >= 0}
        untouched = [s for s in range(64) if s not in written]
        assert int(data.reshape(64, -1)[untouched].abs().sum()) == 0  # padding rows wrote nothing


def test_store_subtracts_k_centre():
    centre = torch.randn(2, 64)
    layer = _layer("bf16", "bf16", k_centre=centre)
    kx = torch.randn(3, 2, 64) + centre
    store(layer, kx, kx, torch.tensor([0, 1, 2]), backend="reference")
    data, scales = block_views(layer.k_codec, layer.k_pool, 16, 2, 64)
    got = codec_ref.decode(layer.k_codec, data[0, :3], scales[0, :3], 64)
    torch.testing.assert_close(got, (kx - centre).bfloat16().float())


def test_store_k_only_and_v_only():
    layer = _layer()
    store(layer, None, torch.randn(2, 2, 64), torch.tensor([0, 1]))
    assert int(layer.k_pool.abs().sum()) == 0 and int(layer.v_pool.abs().sum()) > 0
    store(layer, torch.randn(2, 2, 64), None, torch.tensor([0, 1]))
    assert int(layer.k_pool.abs().sum()) > 0


@pytest.mark.parametrize("bad,arg", [
    (dict(k=torch.randn(3, 2, 64).index_put_((torch.tensor(1),), torch.tensor(float("nan")))), "k"),
    (dict(v=torch.full((3, 2, 64), float("inf"))), "v"),
    (dict(k=torch.randn(3, 2, 32)), "k"),
    (dict(v=torch.randn(3, 2, 64).int()), "v"),
    (dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32)), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0, 1, 64])), "slot_mapping"),
    (dict(slot_mapping=torch.tensor([0, 1])), "k"),
    (dict(slot_mapping=torch.tensor([5, -1, 5])), "same slot twice"),
])
def test_store_rejects_bad_input_before_writing(bad, arg):
    layer = _layer()
    kwargs = dict(k=torch.randn(3, 2, 64), v=torch.randn(3, 2, 64), slot_mapping=torch.tensor([0, 1, 2]))
    kwargs.update(bad)
    with pytest.raises(InvalidInput, match=arg):
        store(layer, **kwargs)
    assert int(layer.k_pool.abs().sum()) == 0 and int(layer.v_pool.abs().sum()) == 0


# ---- attention validation ------------------------------------------------------------------
def _decode_args(layer):
    return dict(q=torch.randn(2, 6, 64), layer=layer, block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([20, 5], dtype=torch.int32), params=P)


@pytest.mark.parametrize("bad,arg", [
    (dict(q=torch.randn(2, 5, 64)), "q has 5 heads"),
    (dict(q=torch.randn(2, 6, 128)), "head_dim"),
    (dict(q=torch.full((2, 6, 64), float("nan"))), "q holds NaN"),
    (dict(q=torch.randn(2, 6, 64).double()), "q must have dtype"),
    (dict(block_tables=torch.tensor([[0, 1], [2, 3]])), "block_tables must have dtype int32"),
    (dict(block_tables=torch.tensor([[0, 9], [2, 3]], dtype=torch.int32)), "block ids"),
    (dict(seq_lens=torch.tensor([20, 33], dtype=torch.int32)), "seq_lens must be in"),
    (dict(seq_lens=torch.tensor([20], dtype=torch.int32)), "one per sequence"),
    (dict(params=AttentionParams(scale=0.0)), "params.scale"),
    (dict(params=AttentionParams(scale=0.1, sliding_window=0)), "sliding_window"),
    (dict(params=AttentionParams(scale=0.1, soft_cap=-1.0)), "soft_cap"),
    (dict(params=AttentionParams(scale=0.1, sparse_v_threshold=1.5)), "sparse_v_threshold"),
    (dict(params=AttentionParams(scale=0.1, sinks=torch.zeros(3))), r"params.sinks must have shape \[6\]"),
    (dict(params="fast"), "AttentionParams"),
])
def test_decode_rejects_bad_input(bad, arg):
    args = _decode_args(_filled())
    args.update(bad)
    with pytest.raises(InvalidInput, match=arg):
        decode_attention(**args)


def test_decode_rejects_bad_layer():
    layer = _filled()
    broken = make_layer(CODECS["turbo3"], CODECS["turbo4"], 4, 16, 2, 64)
    object.__setattr__(broken, "k_pool", torch.zeros(4, 10, dtype=torch.uint8))
    args = _decode_args(layer)
    args["layer"] = broken
    with pytest.raises(InvalidInput, match="layer.k_pool must be uint8"):
        decode_attention(**args)


@pytest.mark.parametrize("qsl,arg", [
    ([0, 3, 2], "never decrease"),
    ([0, 3, 6], "end at Tq"),
    ([0, 3], "B\\+1"),
    ([0, 1, 7], "more queries than tokens"),
])
def test_prefill_rejects_bad_query_start_loc(qsl, arg):
    layer = _filled()
    q = torch.randn(7, 6, 64) if qsl[-1] == 7 else torch.randn(5, 6, 64)
    with pytest.raises(InvalidInput, match=arg):
        prefill_attention(q, layer, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                          torch.tensor([20, 5], dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32), P)


def test_output_keeps_q_dtype():
    layer = _filled()
    args = _decode_args(layer)
    args["q"] = args["q"].bfloat16()
    assert decode_attention(**args, backend="reference").dtype == torch.bfloat16


# ---- dispatch ------------------------------------------------------------------------------
def _recording_backend(name, calls, supports=lambda op, layer, params: True, priority=50):
    def rec(op):
        impl = {"store": reference.store, "decode": reference.decode_attention, "prefill": reference.prefill_attention}[op]

        def f(*a):
            calls.append((name, op))
            return impl(*a)
        return f
    return Backend(name=name, device_types=("cpu",), store=rec("store"), decode_attention=rec("decode"),
                   prefill_attention=rec("prefill"), supports=supports, priority=priority)


def test_dispatch_prefers_registered_backend_and_respects_override():
    calls = []
    register_backend(_recording_backend("test-fast", calls, priority=10_000))
    try:
        args = _decode_args(_filled())
        out = decode_attention(**args)
        assert calls == [("test-fast", "decode")]
        ref = decode_attention(**args, backend="reference")
        assert calls == [("test-fast", "decode")]  # override bypassed it
        torch.testing.assert_close(out, ref)
        assert get_backend("test-fast").name == "test-fast"
    finally:
        dispatch.unregister_backend("test-fast")


def test_dispatch_falls_back_when_backend_declines():
    calls = []
    declines = _recording_backend("test-picky", calls, supports=lambda op, layer, params: layer.k_codec.name != "turbo3",
                                  priority=10_000)
    register_backend(declines)
    try:
        layer = _filled("turbo3", "turbo4")
        chosen = select_backend(Op.DECODE, layer.device, layer, P)
        assert chosen.name != "test-picky"
        decode_attention(**_decode_args(layer))
        assert calls == []
        with pytest.raises(InvalidInput, match="does not support"):
            decode_attention(**_decode_args(layer), backend="test-picky")
    finally:
        dispatch.unregister_backend("test-picky")


def test_unknown_backend_and_wrong_device():
    layer = _filled()
    with pytest.raises(ConfigError, match="registered backends: .*reference"):
        decode_attention(**_decode_args(layer), backend="warp-drive")
    gpu_only = Backend(name="test-gpu", device_types=("cuda",), store=reference.store,
                       decode_attention=reference.decode_attention, prefill_attention=reference.prefill_attention)
    with pytest.raises(InvalidInput, match="runs on cuda"):
        decode_attention(**_decode_args(layer), backend=gpu_only)
    with pytest.raises(ConfigError):
        dispatch.unregister_backend("reference")
