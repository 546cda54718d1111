"""The approximate integer score path (`AttentionParams.int8_scores`) of the CPU kernel.

For every (K, V) codec pair (looped from the registry) the decode output is compared with the
exact reference under a tolerance derived from the quantization (ops/cpu/attention_i8.h): each
score q.k_j moves by at most
    eps_j = (sq / 2) * sum_d |k_jd| + rho * sum_d |q_d| |k_jd|,
sq = max|q| / 127 (q in the kernel's basis, scaled) and rho = the largest relative rounding of a
code level to the kernel's 7-bit image (0 for integer levels); softmax weights then change by a
factor within exp(+-2 eps), so |out - ref| <= (exp(2 max_j eps_j) - 1) * max_j |v_j|_2
(+ the exact path's summation-order allowance). Codecs the integer path does not take compute
exactly: their output must be bit-identical to the exact call. A second oracle computes the
stated integer arithmetic itself in float64 (q8 * sq against the levels' 7-bit image times the
stored group scales, exact softmax and V): the kernel must match it to summation order.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers.approx_checks import (assert_matches_simulation, assert_switch_off_by_default_and_validated,
                                   assert_within_score_bound, simulated_decode, skip_unless_kernel_reads)
from helpers.backend_check import CheckCase, all_pairs

from pagedkv.formats import all_formats

from pagedkv.codecs import packing, wht
from pagedkv.codecs.catalogue import CODECS, ScaleType
from pagedkv.codecs.derive import DecodeKind
from pagedkv.codecs.floats import from_e4m3_bytes, from_half_bytes
from pagedkv.codecs.layout import block_views
from pagedkv.ops import reference, transform
from pagedkv.ops.reference.attention import gather_rows

cpu = pytest.importorskip("pagedkv.ops.cpu")
if not cpu.available():
    pytestmark = pytest.mark.skip(reason=f"CPU kernel unavailable: {cpu.kernel_info()}")


def takes_integer_path(codec) -> bool:
    t = codec.traits
    return (cpu.kernel_info().get("variant") in ("avx2", "avx512") and t.decode in (DecodeKind.TABLE, DecodeKind.INT_OFFSET)
            and t.bits <= 5 and t.per_group_scale)


def level_image(codec) -> torch.Tensor:
    """float64 [2**bits]: each code level as the kernel rounds it (7-bit integer x ls)."""
    levels = codec.value_table().double().reshape(-1)
    amax = float(levels.abs().max())
    integral = bool((levels == levels.round()).all())
    ls = 1.0 if integral and amax <= 63 else amax / 63
    return (levels / ls).round().clamp(-63, 63) * ls


def level_rounding(codec) -> float | None:
    """rho of the codec's levels (as attention_i8.h rounds them), or None: no integer path."""
    if not takes_integer_path(codec):
        return None
    levels = codec.value_table().double().reshape(-1)
    image = level_image(codec)
    nz = levels != 0
    return float(((image - levels).abs()[nz] / levels.abs()[nz]).max()) if bool(nz.any()) else 0.0


def score_error_bound(case, params, rho: float) -> torch.Tensor:
    """max_j eps_j per (sequence, q head): float64 [B, Hq]."""
    layer = case.layer
    h, d = layer.num_kv_heads, layer.head_dim
    q = case.q_decode
    hq = q.shape[1]
    qk = transform.query_for_keys(layer, q).float()
    qk = (wht.rotate(qk) if layer.k_codec.rotated else qk).double() * params.scale
    out = torch.zeros(q.shape[0], hq, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(case.seq_lens[b])
        if n == 0:
            continue
        k = gather_rows(layer, layer.k_codec, layer.k_pool, layer.k_scale, case.block_tables[b], n).double()
        k = k.repeat_interleave(hq // h, dim=1)  # [n, Hq, D]
        sq = qk[b].abs().amax(-1) / 127  # [Hq]
        eps = sq / 2 * k.abs().sum(-1) + rho * (qk[b].abs()[None] * k.abs()).sum(-1)  # [n, Hq]
        out[b] = eps.amax(0)
    return out


@pytest.mark.parametrize("k,v", all_pairs())
def test_int8_scores_within_derived_bound(k, v):
    check_int8_within_bound(k, v, 64)


@pytest.mark.parametrize("k,head_dim", [("q4_0", 96), ("nvfp4", 32), ("q4_0", 128)])
def test_int8_scores_head_dims_not_multiple_of_64(k, head_dim):
    """The AVX-512 integer path works in 64-dim passes: a last 32 dims (96, 32) read 32 codes
    against a zero-padded query; 128: two full passes."""
    check_int8_within_bound(k, "bf16", head_dim)


def check_int8_within_bound(k, v, head_dim):
    skip_unless_kernel_reads(k, v)
    cc = CheckCase(k, v, seq_lens=(45, 1, 70), num_kv_heads=2, group=3, head_dim=head_dim)
    case = cc.build()
    exact_params = cc.params()
    approx_params = replace(exact_params, int8_scores=True)
    args = (case.q_decode, case.layer, case.block_tables, case.seq_lens)
    ref = reference.decode_attention(*args, exact_params).double()
    exact = cpu.decode_attention(*args, exact_params)
    approx = cpu.decode_attention(*args, approx_params)
    rho = level_rounding(CODECS[k])
    if rho is None:  # no integer path for this K codec: the exact computation, bit for bit
        assert torch.equal(approx, exact), cc.label
        return
    assert not torch.equal(approx, exact), f"{cc.label}: the integer path was not taken"
    assert_within_score_bound(cc.label, case, approx, ref, score_error_bound(case, exact_params, rho))


def kernel_basis_query(case, params) -> torch.Tensor:
    """q as the kernel dots it: [B, Hq, D] float64 (transform, rotation, scale)."""
    qk = transform.query_for_keys(case.layer, case.q_decode).float()
    return (wht.rotate(qk) if case.layer.k_codec.rotated else qk).double() * params.scale


def simulated_integer_decode(case, params) -> torch.Tensor:
    """Decode attention computed in float64 with the integer path's roundings (the oracle of the
    approximation): [B, Hq, D] in the output basis."""
    layer = case.layer
    codec, h, d, bs = layer.k_codec, layer.num_kv_heads, layer.head_dim, layer.block_size
    data, scales = block_views(codec, layer.k_pool, bs, h, d)
    image = level_image(codec)
    g = codec.traits.group
    qk = kernel_basis_query(case, params)
    sq = qk.abs().amax(-1, keepdim=True) / 127
    q8 = (qk / sq).round().clamp(-127, 127) * sq  # [B, Hq, D]

    def keys(b, n):
        ids = case.block_tables[b][: -(-n // bs)].long()
        rows = data[ids].reshape(-1, h, data.shape[-1])[:n]
        srows = scales[ids].reshape(-1, h, scales.shape[-1])[:n]
        sc = from_e4m3_bytes(srows) if codec.scale_type is ScaleType.FP8_E4M3 else \
            from_half_bytes(srows, torch.bfloat16 if codec.scale_type is ScaleType.BF16 else torch.float16)
        codes = packing.unpack(rows, codec.code_bits, d).long()
        return (image[codes].reshape(n, h, d // g, g) * sc.double().reshape(n, h, d // g, 1)).reshape(n, h, d)

    return simulated_decode(case, q8, keys)


@pytest.mark.parametrize("k", sorted({f.k.name for f in all_formats()}))
def test_int8_scores_match_simulated_integer_arithmetic(k):
    check_simulated(CheckCase(k, "bf16", seq_lens=(45, 1, 70), num_kv_heads=2, group=3))


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(8, 2, 64), (24, 2, 64), (16, 8, 64),
                                                              (16, 2, 128), (32, 3, 64)])
def test_int8_scores_scale_layouts(block_size, num_kv_heads, head_dim):
    """The AVX-512 integer path reads a chunk's K group scales transposed (i8_scales_t): by byte
    permutes where a 16-token group's scales are one run of at most 16 bytes per token, else decoded
    and transposed in registers. Blocks of 8 and 24 tokens put 16-token groups across blocks, 8 kv
    heads x 4 chunks are 32 scales per token, head_dim 128 x 2 heads exactly 16, blocks of 32 two
    groups per block: a scale in the wrong lane moves the output far past summation order."""
    check_simulated(CheckCase("turbo3", "bf16", seq_lens=(45, 1, 70, 33), num_kv_heads=num_kv_heads, group=2,
                              head_dim=head_dim, block_size=block_size))


def check_simulated(cc):
    k = cc.k_codec
    if not takes_integer_path(CODECS[k]):
        pytest.skip(f"{k}: no integer path (exact scores, tested above)")
    case = cc.build()
    params = cc.params()
    approx = cpu.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens,
                                  replace(params, int8_scores=True))
    assert_matches_simulation(cc.label, case, approx, simulated_integer_decode(case, params), 2e-4, "integer path")


def test_int8_scores_is_off_by_default_and_validated():
    assert_switch_off_by_default_and_validated("int8_scores", "turbo3", "int8_scores")


def test_int8_scores_split_across_threads():
    """A sequence split into block ranges over threads (partial softmax states merged by
    log-sum-exp) gives the 1-thread integer result to summation order: each split reads its own
    chunks' transposed scales (i8_scales_t), whatever block a range starts at."""
    if not takes_integer_path(CODECS["turbo3"]):
        pytest.skip("no integer path on this kernel build")
    cc = CheckCase("turbo3", "turbo3", seq_lens=(700, 3, 260), num_kv_heads=3, group=3, block_size=8)
    case = cc.build()
    params = replace(cc.params(), int8_scores=True)
    qsl = torch.arange(case.batch + 1, dtype=torch.int32)
    outs = [cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl, params, num_threads=t)
            for t in (1, 2, 4)]
    exact = cpu.attention(case.q_decode, case.layer, case.block_tables, case.seq_lens, qsl, cc.params(), num_threads=1)
    assert not torch.equal(outs[0], exact), "the integer path was not taken"
    for t, got in zip((2, 4), outs[1:]):
        assert (got - outs[0]).abs().max() < 2e-5, t
