"""Memory safety and finite outputs whatever the value checks (issue 12 items 6, 8, 9).

- `checks=False` skips the value scans (NaN/Inf, duplicate slots), never memory safety: on CPU
  tensors the index checks (one min/max per index tensor, no device sync to pay) always run and
  raise InvalidInput; on CUDA, where they would cost a host sync, the Triton kernels mask and
  clamp instead (a slot past the pool writes nothing, a block id past the pool reads a block
  inside it). Tested here on guard bytes just past the pool, which a wild write would change.
- q8_0 / q4_0 saturate their fp16 group scale: finite inputs never decode to NaN / Inf.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv.codecs import CODECS
from pagedkv.codecs import reference as codec_ref
from pagedkv.errors import InvalidInput
from pagedkv.ops import AttentionParams, PagedLayer, api, make_layer

PARAMS = AttentionParams(scale=0.125)


def _guarded(codec_k, codec_v, num_blocks=2, bs=16, h=1, d=64, device="cpu"):
    """A layer whose pools are views of larger buffers: the rows past the pool are guard bytes."""
    base = make_layer(codec_k, codec_v, num_blocks + 2, bs, h, d, device=device)
    kbuf, vbuf = base.k_pool.fill_(0x5A), base.v_pool.fill_(0x5A)
    layer = PagedLayer(kbuf[:num_blocks], vbuf[:num_blocks], codec_k, codec_v, bs, h, d,
                       base.k_scale, base.v_scale)
    return layer, kbuf, vbuf


def _guards_intact(kbuf, vbuf, num_blocks=2) -> bool:
    return bool((kbuf[num_blocks:] == 0x5A).all()) and bool((vbuf[num_blocks:] == 0x5A).all())


@pytest.mark.parametrize("backend", [None, "reference"])
def test_a_slot_past_the_pool_is_refused_without_checks(backend):
    layer, kbuf, vbuf = _guarded(CODECS["turbo3"], CODECS["q8_0"])
    x = torch.randn(2, 1, 64)
    for slots in (torch.tensor([3, 32]), torch.tensor([3, 1 << 40])):  # 32 = first slot past 2 x 16
        with pytest.raises(InvalidInput, match="slot_mapping holds slot"):
            api.store(layer, x, x, slots, backend=backend, checks=False)
    assert _guards_intact(kbuf, vbuf)
    assert bool((kbuf[:2] == 0x5A).all())  # nothing was written: refused before any write


def _cpu_available() -> bool:
    try:
        from pagedkv.ops import cpu
    except ImportError:
        return False
    return cpu.available()


BACKENDS = ["reference", pytest.param("cpu", marks=pytest.mark.skipif(not _cpu_available(),
                                                                      reason="CPU kernel unavailable"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("checks", [True, False])
def test_a_bad_slot_is_refused_by_name_before_any_write(backend, checks):
    """The slot checks have one owner (`validate.check_store`, run before the backend's store):
    a slot past the pool (always) or written twice (with checks) raises InvalidInput naming it,
    on the reference and the C store alike, and no byte of either pool or of the guard rows past
    it changes. A negative slot is not bad: it means skip, its row is not written."""
    layer, kbuf, vbuf = _guarded(CODECS["turbo3"], CODECS["q8_0"])  # a rotated K, a C-encoded V
    x = torch.randn(3, 1, 64)
    before_k, before_v = kbuf.clone(), vbuf.clone()
    bad = [(torch.tensor([3, 32, 4]), "holds slot 32 "), (torch.tensor([3, 4, 1 << 40]), f"holds slot {1 << 40} ")]
    if checks:  # a value check: skipped with checks off
        bad.append((torch.tensor([5, -1, 5]), r"same slot twice \(slot 5\)"))
    for slots, match in bad:
        with pytest.raises(InvalidInput, match=match):
            api.store(layer, x, x, slots, backend=backend, checks=checks)
        assert torch.equal(kbuf, before_k) and torch.equal(vbuf, before_v), slots.tolist()
    api.store(layer, x, x, torch.tensor([-1, -7, -1]), backend=backend, checks=checks)
    assert torch.equal(kbuf, before_k) and torch.equal(vbuf, before_v)  # every row skipped
    api.store(layer, x, x, torch.tensor([-1, 17, -3]), backend=backend, checks=checks)
    want, wk, wv = _guarded(CODECS["turbo3"], CODECS["q8_0"])
    api.store(want, x[1:2], x[1:2], torch.tensor([17]), backend="reference")
    assert torch.equal(kbuf, wk) and torch.equal(vbuf, wv)  # row 1 alone, at slot 17 (block 1)
    assert torch.equal(kbuf[0], before_k[0]) and _guards_intact(kbuf, vbuf)


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_block_ids_and_lengths_past_the_tables_are_refused_without_checks(mode):
    layer, _, _ = _guarded(CODECS["turbo3"], CODECS["turbo3"])
    q = torch.randn(1, 2, 64)
    good = torch.tensor([[0, 1]], dtype=torch.int32)
    cases = [
        (torch.tensor([[0, 7]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), "block ids"),
        (torch.tensor([[0, -3]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32), "block ids"),
        (good, torch.tensor([33], dtype=torch.int32), "seq_lens must be in"),
    ]
    for tables, lens, match in cases:
        with pytest.raises(InvalidInput, match=match):
            if mode == "decode":
                api.decode_attention(q, layer, tables, lens, PARAMS, checks=False)
            else:
                api.prefill_attention(q, layer, tables, lens, torch.tensor([0, 1], dtype=torch.int32),
                                      PARAMS, checks=False)
    if mode == "prefill":  # query offsets past q would read outside it
        with pytest.raises(InvalidInput, match="query_start_loc"):
            api.prefill_attention(q, layer, good, torch.tensor([20], dtype=torch.int32),
                                  torch.tensor([0, 5], dtype=torch.int32), PARAMS, checks=False)


@pytest.mark.parametrize("name, big", [("q8_0", 2e7), ("q4_0", 1e6), ("q4_0", -3e38)])
def test_int_codecs_saturate_their_fp16_scale(name, big):
    """|x| above ~8.3e6 (q8_0) or ~5.2e5 (q4_0) overflowed the fp16 scale: decode gave NaN."""
    codec = CODECS[name]
    x = torch.randn(4, 2, 64)
    x[1, 0, 5] = big
    x[2, 1, :32] = -abs(big)
    out = codec_ref.roundtrip(codec, x)
    assert bool(torch.isfinite(out).all())
    sat = 65504.0 * (127 if name == "q8_0" else 8)
    assert float(out.abs().max()) <= sat * 1.001
    assert float(out[1, 0, 5].abs()) >= 0.5 * min(abs(big), sat)  # saturated, not zeroed
    torch.testing.assert_close(out[0], codec_ref.roundtrip(codec, x[0]))  # other rows unchanged
    layer = make_layer(codec, codec, 2, 16, 2, 64)
    api.store(layer, x, x, torch.arange(4))  # the automatic (C) store writes the same bytes
    ref = make_layer(codec, codec, 2, 16, 2, 64)
    api.store(ref, x, x, torch.arange(4), backend="reference")
    assert torch.equal(layer.k_pool, ref.k_pool) and torch.equal(layer.v_pool, ref.v_pool)
    tables, lens = torch.tensor([[0]], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    for backend in (None, "reference"):
        o = api.decode_attention(torch.randn(1, 2, 64), layer, tables, lens, PARAMS, backend=backend)
        assert bool(torch.isfinite(o).all()), backend


@pytest.mark.parametrize("backend", [None, "reference"])
@pytest.mark.parametrize("checks", [True, False])
def test_a_nan_in_v_leaves_both_pools_unchanged(backend, checks):
    """Issue 12 item 10: a store is all-or-nothing also with checks off (K was written before V's
    NaN was found)."""
    for k_name, v_name in (("turbo3", "turbo3"), ("q8_0", "fp8"), ("bf16", "turbo4")):
        layer, kbuf, vbuf = _guarded(CODECS[k_name], CODECS[v_name])
        k, v = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
        v[2, 0, 5] = float("nan")
        before_k, before_v = kbuf.clone(), vbuf.clone()
        with pytest.raises(InvalidInput, match="NaN"):
            api.store(layer, k, v, torch.tensor([0, 1, 2]), backend=backend, checks=checks)
        assert torch.equal(kbuf, before_k) and torch.equal(vbuf, before_v), (k_name, v_name)


@pytest.mark.parametrize("checks", [True, False])
def test_finite_rows_whose_sum_overflows_are_stored_and_an_inf_is_not(checks):
    """The finite-value scan sums each side first (`validate.check_store_finite`): a sum that
    overflows on finite rows must fall through to the element-wise scan and pass, and an Inf
    among them still be refused before any write."""
    from pagedkv.ops import validate

    big = torch.full((3, 1, 64), 3e38)  # finite fp32; the fp32 sum is +Inf
    assert not torch.isfinite(big.sum())
    validate.check_store_finite(big, big.to(torch.bfloat16), torch.tensor([0, 1, 2]))
    layer, kbuf, vbuf = _guarded(CODECS["bf16"], CODECS["fp8"])
    k, v = torch.full((3, 1, 64), 1e38), torch.randn(3, 1, 64)
    k[1, 0, 7] = float("inf")
    before_k, before_v = kbuf.clone(), vbuf.clone()
    with pytest.raises(InvalidInput, match="k holds NaN or Inf"):
        api.store(layer, k, v, torch.tensor([0, 1, 2]), checks=checks)
    assert torch.equal(kbuf, before_k) and torch.equal(vbuf, before_v)


@pytest.mark.parametrize("backend", [None, "reference"])
def test_a_nan_in_a_skipped_row_is_not_rejected(backend):
    """Issue 12 item 10: rows with a negative slot are padding the store skips; their values are
    not the caller's data and are not scanned. The stored rows equal a store without the pad row."""
    layer, _, _ = _guarded(CODECS["turbo3"], CODECS["q8_0"])
    ref, _, _ = _guarded(CODECS["turbo3"], CODECS["q8_0"])
    k, v = torch.randn(3, 1, 64), torch.randn(3, 1, 64)
    k[1], v[1] = float("nan"), float("inf")
    api.store(layer, k, v, torch.tensor([0, -1, 1]), backend=backend)
    api.store(ref, k[[0, 2]], v[[0, 2]], torch.tensor([0, 1]), backend=backend)
    assert torch.equal(layer.k_pool, ref.k_pool) and torch.equal(layer.v_pool, ref.v_pool)
