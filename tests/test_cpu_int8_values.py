"""The approximate integer P.V path (`AttentionParams.int8_values`) of the CPU kernel.

Stated arithmetic (ops/cpu/attention_v8.h): per query vector m and chunk C of 64 tokens (the
kernel's unit, block size 16), with p the softmax weights and s(i, c) the decoded scale of token
i's 16-dim chunk c, w_ic = p_i s(i, c), wsc = max_{i in C, c} |w_ic| / 127, wq = round(w / wsc),
and lev = round(level / ls) in [-63, 63] (the 7-bit level image, ls its unit); the output (in the
basis V is stored in) is o~_d = sum_C wsc ls sum_{i in C} wq_{i,c(d)} lev_{i,d}. Its error against
the exact o_d = sum_i w_{i,c(d)} level_{i,d} is at most
    sum_i (wsc / 2) ls |lev_{i,d}| + sum_i |w_{i,c(d)}| |ls lev_{i,d} - level_{i,d}|
(the weights' rounding against the level image, the levels' rounding against the exact weights,
|ls lev - level| <= ls / 2), p already divided by the softmax denominator.

For every (K, V) pair of the registry: V sides with no integer path (or builds without the AVX-512
path, or head_dim not a multiple of 64) must give the exact call's output bit for bit; the others
must match a float64 oracle of the arithmetic above (to summation order, plus the weights whose
rounding is a near tie, where the kernel's fp32 weights may round the other way), and stay within
the bound of the exact reference. The kernel runs on one thread here, so that its chunks are the
64-token ranges from position 0 (split block ranges would start chunks elsewhere).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.approx_checks import (assert_switch_off_by_default_and_validated, integer_keys, integer_query,
                                   kernel_basis_query, level_ints, level_unit, skip_unless_kernel_reads,
                                   stored_codes_scales)
from helpers.backend_check import CheckCase, all_pairs

from pagedkv.codecs import wht
from pagedkv.codecs.catalogue import CODECS
from pagedkv.codecs.derive import DecodeKind
from pagedkv.ops import reference
from pagedkv.ops.reference.attention import gather_rows

cpu = pytest.importorskip("pagedkv.ops.cpu")
if not cpu.available():
    pytestmark = pytest.mark.skip(reason=f"CPU kernel unavailable: {cpu.kernel_info()}")

CHUNK = 64  # tokens per kernel chunk at block size 16
TIE = 2e-3  # |w / wsc| this close to a rounding tie may round either way in the kernel's fp32


def takes_value_path(codec, head_dim: int) -> bool:
    t = codec.traits
    return (cpu.kernel_info().get("variant") == "avx512" and head_dim % 64 == 0 and t.bits <= 4
            and t.decode in (DecodeKind.TABLE, DecodeKind.INT_OFFSET) and t.per_group_scale)


def takes_score_path(codec) -> bool:
    t = codec.traits
    return (cpu.kernel_info().get("variant") in ("avx2", "avx512") and t.bits <= 4
            and t.decode in (DecodeKind.TABLE, DecodeKind.INT_OFFSET) and t.per_group_scale)


def run(case, params, **flags) -> torch.Tensor:
    """The kernel's decode on one thread with the given AttentionParams switches."""
    qsl = torch.arange(case.q_decode.shape[0] + 1, dtype=torch.int32)
    return cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl,
                         replace(params, **flags), num_threads=1)


def softmax_weights(case, params, int8_scores: bool) -> list:
    """Per sequence the softmax weights [Hq, n] (float64) the kernel's scores give: exact, or the
    integer score path's (rounded query, 7-bit key levels) where it applies."""
    layer = case.layer
    h = layer.num_kv_heads
    integer = int8_scores and takes_score_path(layer.k_codec)
    q = integer_query(case, params) if integer else kernel_basis_query(case, params)
    out = []
    for b in range(q.shape[0]):
        n = int(case.seq_lens[b])
        k = integer_keys(case, b, n) if integer else \
            gather_rows(layer, layer.k_codec, layer.k_pool, layer.k_scale, case.block_tables[b], n).double()
        k = k.repeat_interleave(q.shape[1] // h, dim=1)  # [n, Hq, D]
        out.append(torch.softmax(torch.einsum("hd,nhd->hn", q[b], k), dim=-1))
    return out


def simulated_values(case, weights: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer P.V of the module docstring in float64 for the softmax weights given, in the
    basis V is stored in: (output, near-tie allowance, error bound), each [B, Hq, D]."""
    layer = case.layer
    codec, h, d = layer.v_codec, layer.num_kv_heads, layer.head_dim
    ls, lev_of = level_unit(codec), level_ints(codec)
    table = codec.value_table().double().reshape(-1)
    hq = weights[0].shape[0] if weights else h
    outs = [torch.zeros(len(weights), hq, d, dtype=torch.float64) for _ in range(3)]
    for b, p in enumerate(weights):
        n = p.shape[1]
        if n == 0:
            continue
        codes, sc = stored_codes_scales(case, "v", b, n)  # [n, H, D], [n, H, D / group]
        lev = lev_of[codes].repeat_interleave(hq // h, dim=1).transpose(0, 1)  # [Hq, n, D]
        err_lev = (ls * lev_of[codes] - table[codes]).abs().repeat_interleave(hq // h, dim=1).transpose(0, 1)
        s = sc.repeat_interleave(d // sc.shape[-1], dim=-1).repeat_interleave(hq // h, dim=1).transpose(0, 1)
        w = p[..., None] * s  # [Hq, n, D]: each dim carries its chunk's weight
        for c0 in range(0, n, CHUNK):
            wc, lc = w[:, c0:c0 + CHUNK], lev[:, c0:c0 + CHUNK]
            wsc = wc.abs().flatten(1).amax(1)[:, None, None] / 127  # [Hq, 1, 1]
            x = torch.where(wsc > 0, wc / wsc, torch.zeros_like(wc))
            tie = ((x.abs() - x.abs().floor()) - 0.5).abs() < TIE
            outs[0][b] += (wsc * ls * x.round() * lc).sum(1)
            outs[1][b] += (tie * wsc * ls * lc.abs()).sum(1)
            outs[2][b] += (wsc / 2 * ls * lc.abs() + wc.abs() * err_lev[:, c0:c0 + CHUNK]).sum(1)
    return outs[0], outs[1], outs[2]


def stored_basis(layer, out: torch.Tensor) -> torch.Tensor:
    """A kernel output [B, Hq, D] back in the basis V is stored in (float64)."""
    return (wht.rotate(out.float()) if layer.v_codec.rotated else out).double()


def check_values(cc: CheckCase, int8_scores: bool = False) -> None:
    """int8_values against the exact call (bit-identical without an integer path), the float64 oracle
    and the error bound (against the reference, or against the call with the same integer scores)."""
    skip_unless_kernel_reads(cc.k_codec, cc.v_codec)
    case = cc.build()
    params = replace(cc.params(), int8_scores=int8_scores)
    exact = run(case, params)
    approx = run(case, params, int8_values=True)
    if not takes_value_path(CODECS[cc.v_codec], cc.head_dim):
        assert torch.equal(approx, exact), f"{cc.label}: no integer P.V here, yet the output changed"
        return
    assert not torch.equal(approx, exact), f"{cc.label}: the integer P.V was not taken"
    layer = case.layer
    oracle, ties, bound = simulated_values(case, softmax_weights(case, params, int8_scores))
    got = stored_basis(layer, approx)
    rms_v = torch.cat([x.reshape(-1) for x in case.v_deq]).pow(2).mean().sqrt()
    slack = 1e-5 * bound + 2e-5 * rms_v  # fp32 sums and weights (relative ~1e-6), the exact path's own
    err = (got - oracle).abs()
    assert bool((err <= ties + slack).all()), \
        f"{cc.label}: |kernel - oracle| {float(err.max()):.3g} beyond the near-tie allowance {float((ties + slack).max()):.3g}"
    # the bound, against the exact computation with the same softmax weights: the reference (exact
    # scores) or the kernel's exact-V call (integer scores); plus the exact path's summation order
    ref = exact if int8_scores else reference.decode_attention(case.q_decode, layer, case.block_tables,
                                                               case.seq_lens, cc.params())
    dev = (got - stored_basis(layer, ref)).abs()
    tol = bound * (1 + 1e-3) + 2e-4 * rms_v
    assert bool((dev <= tol).all()), f"{cc.label}: error {float(dev.max()):.3g} > bound {float(tol[dev > tol].min()):.3g}"


@pytest.mark.parametrize("k,v", all_pairs())
def test_int8_values_match_oracle_within_bound(k, v):
    check_values(CheckCase(k, v, seq_lens=(45, 1, 70), num_kv_heads=2, group=3))


@pytest.mark.parametrize("k,v,head_dim", [("turbo3", "turbo3", 128), ("q4_0", "q4_0", 128), ("bf16", "q4_0", 96),
                                          ("turbo4", "nvfp4", 96)])
def test_int8_values_head_dims(k, v, head_dim):
    """128: two 64-dim passes per token; 96 (not a multiple of 64): the exact P.V, bit for bit."""
    check_values(CheckCase(k, v, seq_lens=(45, 1, 70), num_kv_heads=2, group=3, head_dim=head_dim))


@pytest.mark.parametrize("k,v", [("turbo3", "turbo3"), ("turbo4", "turbo4"), ("q4_0", "nvfp4"), ("bf16", "turbo2"),
                                 ("turbo2", "q8_0")])
def test_int8_values_with_int8_scores(k, v):
    """Both integer paths: the oracle takes the integer scores' softmax weights; the bound holds
    against the call with the same scores and exact values."""
    check_values(CheckCase(k, v, seq_lens=(45, 1, 70, 130), num_kv_heads=2, group=3), int8_scores=True)


def test_int8_values_with_sparse_v():
    """Sparse V: skipped rows have weight 0 in both calls, so the bound of the full weights holds
    between the sparse exact and the sparse integer call (skipping only lowers wsc and |w|)."""
    cc = CheckCase("turbo3", "turbo4", seq_lens=(45, 1, 70, 200), num_kv_heads=2, group=3, sparse_v_threshold=0.01)
    case = cc.build()
    params = cc.params()
    exact, approx = run(case, params), run(case, params, int8_values=True)
    if not takes_value_path(CODECS["turbo4"], cc.head_dim):
        assert torch.equal(approx, exact)
        return
    _, _, bound = simulated_values(case, softmax_weights(case, params, False))
    rms_v = torch.cat([x.reshape(-1) for x in case.v_deq]).pow(2).mean().sqrt()
    dev = (stored_basis(case.layer, approx) - stored_basis(case.layer, exact)).abs()
    assert not torch.equal(approx, exact), "the integer P.V was not taken"
    assert bool((dev <= bound * (1 + 1e-3) + 2e-4 * rms_v).all()), f"error {float(dev.max()):.3g}"


def test_int8_values_is_off_by_default_and_validated():
    assert_switch_off_by_default_and_validated("int8_values")
