"""The backend check helper: the reference passes, broken backends are caught, and every fast
backend registered for the CPU passes on a small grid."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.backend_check import CheckCase, all_pairs, check_backend, default_cases
from pagedkv.codecs import CODECS
from pagedkv.ops import Op, backends, reference
from pagedkv.ops.reference import attention as ref_attention

SMALL = [
    CheckCase("turbo3", "turbo4", seq_lens=(19, 1, 33), group=3),
    CheckCase("fp8", "turbo2", seq_lens=(40, 7), group=8, num_kv_heads=1, sliding_window=9, soft_cap=20.0, sinks=True),
    CheckCase("turbo4", "bf16", seq_lens=(50,), head_dim=128, block_size=32, centre=True, k_offset=3.0),
]
SPARSE = CheckCase("turbo3", "turbo3", seq_lens=(90, 60), group=3, sparse_v_threshold=2e-2)


def test_default_cases_cover_every_pair_and_the_settings():
    cases = default_cases()
    assert {(c.k_codec, c.v_codec) for c in cases} >= set(all_pairs())
    assert len(all_pairs()) == len(CODECS) ** 2
    assert {c.group for c in cases} >= {1, 3, 8} and {c.head_dim for c in cases} >= {64, 128, 256}
    assert {c.block_size for c in cases} >= {16, 32}
    assert any(c.sinks for c in cases) and any(c.soft_cap for c in cases) and any(c.sliding_window for c in cases)
    assert any(c.centre for c in cases) and any(c.sparse_v_threshold for c in cases)


def test_reference_passes_its_own_check():
    rows = check_backend(decode_attention=reference.decode_attention, prefill_attention=reference.prefill_attention,
                         store=reference.store, cases=SMALL + [SPARSE])
    assert all(r["decode_max_err"] == 0.0 for r in rows)


def _no_unrotate(q, layer, *a):
    """A classic bug: accumulate a rotated V and forget to un-rotate the output."""
    fake = replace_layer(layer, v_rotated=False)
    return reference.decode_attention(q, fake, *a)


def replace_layer(layer, v_rotated):
    codec = replace(layer.v_codec, rotated=v_rotated)
    return type(layer)(layer.k_pool, layer.v_pool, layer.k_codec, codec, layer.block_size, layer.num_kv_heads,
                       layer.head_dim, layer.k_scale, layer.v_scale, layer.k_centre)


def test_catches_a_missing_unrotation():
    with pytest.raises(AssertionError, match="decode"):
        check_backend(decode_attention=_no_unrotate, cases=SMALL[:1])


def test_catches_a_store_in_the_wrong_slot():
    def shifted(layer, k, v, slots):
        reference.store(layer, k, v, torch.where(slots >= 0, slots ^ 1, slots))  # swaps neighbours
    with pytest.raises(AssertionError, match="pool differs"):
        check_backend(store=shifted, cases=SMALL[:1])


def _sparse_variant(fraction, renormalise):
    """Decode whose sparse V drops positions with p < fraction * t (a subset of the reference's
    when fraction <= 1), optionally renormalising the kept weights."""
    def attend(q, k, v, q_pos, layer, params):
        params = replace(params, sparse_v_threshold=params.sparse_v_threshold * fraction)
        out = original(q, k, v, q_pos, layer, params)
        if renormalise:  # sum of the kept weights: the same attention over V = 1, no un-rotation
            kept = original(q, k, torch.ones_like(v), q_pos, replace_layer(layer, False), params)
            out = out / kept.clamp_min(1e-30)
        return out

    original = ref_attention.attend

    def decode(q, layer, tables, lens, params):
        ref_attention.attend = attend  # decode_attention looks `attend` up at call time
        try:
            return ref_attention.decode_attention(q, layer, tables, lens, params)
        finally:
            ref_attention.attend = original
    return decode


def test_sparse_v_subset_passes_superset_and_renormalising_fail():
    rows = check_backend(decode_attention=_sparse_variant(0.25, renormalise=False), cases=[SPARSE])
    assert rows[0]["decode_max_diff"] > 1e-3  # it did differ from the reference, within the interval
    for fraction, renormalise in ((4.0, False), (1.0, True), (0.5, True)):
        with pytest.raises(AssertionError, match="outside the sparse-V interval"):
            check_backend(decode_attention=_sparse_variant(fraction, renormalise), cases=[SPARSE])


def test_registered_cpu_backends_match_the_reference():
    fast = [b for b in backends("cpu") if b.name != "reference"]
    if not fast:
        pytest.skip("no fast CPU backend registered (no compiler?)")
    for b in fast:
        for case in SMALL + [SPARSE]:
            if not b.supports(Op.DECODE, case.build().layer, case.params()):
                continue
            check_backend(decode_attention=b.decode_attention, prefill_attention=b.prefill_attention,
                          cases=[case], atol=2e-3, rtol=2e-3)
