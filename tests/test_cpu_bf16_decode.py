"""bf16 products in the CPU kernel's decode scores (`AttentionParams.bf16_dots`).

On AVX-512 BF16 builds the decode scores of K sides whose values are exact in bf16 and carry no
group scale (bf16 and fp8 E4M3 keys: `takes_bf16_path`) are computed with vdpbf16ps: q (in the
kernel's basis, scaled) is rounded to bf16, the keys are exact, the products are exact in fp32 and
summed in fp32. Each score s_j = sum_d q_d k_jd therefore moves by at most
    eps_j = (2^-8 + D 2^-24) sum_d |q_d k_jd| + 2^-126 (sum_d |q_d| + sum_d |k_jd| + D)
(2^-8: round-to-nearest bf16, 8 significant bits; D 2^-24: fp32 summation; the last term: vdpbf16ps
treats denormal inputs as zero and flushes denormal sums). The bias, soft-cap (1-Lipschitz), window
and sinks are exact, so each softmax weight moves by a factor within exp(+-2 max_j eps_j) and
|out - ref| <= (exp(2 max_j eps_j) - 1) max_j |v_j|_2 (+ the exact path's summation-order allowance).
Every (K, V) pair of the registry is checked against the exact reference under that bound; pairs
the bf16 path does not take (other K codecs, builds without AVX-512 BF16: the avx2 variant) must
be bit-identical to the exact call. A second oracle computes the stated arithmetic itself in float64
(q rounded to bf16 as the kernel rounds it, exact keys, softmax, values): the kernel must match it to
summation order.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from helpers.approx_checks import (assert_matches_simulation, assert_switch_off_by_default_and_validated,
                                   assert_within_score_bound, simulated_decode, skip_unless_kernel_reads)
from helpers.backend_check import CheckCase, all_pairs

from pagedkv.codecs.catalogue import CODECS
from pagedkv.codecs.derive import DecodeKind
from pagedkv.formats import all_formats
from pagedkv.ops import reference, transform
from pagedkv.ops.reference.attention import gather_rows

cpu = pytest.importorskip("pagedkv.ops.cpu")
if not cpu.available():
    pytestmark = pytest.mark.skip(reason=f"CPU kernel unavailable: {cpu.kernel_info()}")
att = importlib.import_module("pagedkv.ops.cpu.attention")  # the module (cpu.attention is a function)

U = 2.0 ** -8  # bf16 round to nearest even: relative error <= 2^-8 (7 stored bits + the implicit one)


def build_has_bf16() -> bool:
    return cpu.available() and bool(cpu._require().lib.pkv_decode_bf16_available())


def takes_bf16_path(codec) -> bool:
    t = codec.traits
    return build_has_bf16() and t.decode in (DecodeKind.RAW_BF16, DecodeKind.E4M3) and not t.per_group_scale


def kernel_query(case, params) -> torch.Tensor:
    """q as the kernel dots it, before its bf16 rounding: fp32 [B, Hq, D], computed by the same
    ops as ops/cpu/attention.py (query transform, rotation, scale times the K tensor scale)."""
    layer = case.layer
    qf = transform.query_for_keys(layer, case.q_decode)
    q_scale = params.scale * att._tensor_scale(layer.k_codec, layer.k_scale)
    hd = layer.head_dim
    return torch.matmul(qf, att._scaled_rotation_t(hd, q_scale)) if layer.k_codec.rotated else (qf * q_scale)


def stored_keys(case, b: int, n: int) -> torch.Tensor:
    """The keys as the kernel dots them, divided by the K tensor scale (float64 [n, H, D])."""
    layer = case.layer
    k = gather_rows(layer, layer.k_codec, layer.k_pool, layer.k_scale, case.block_tables[b], n).double()
    return k / att._tensor_scale(layer.k_codec, layer.k_scale)


def score_error_bound(case, params) -> torch.Tensor:
    """max_j eps_j per (sequence, q head): float64 [B, Hq] (the module docstring)."""
    layer = case.layer
    h, d = layer.num_kv_heads, layer.head_dim
    q = kernel_query(case, params).double()
    hq = q.shape[1]
    out = torch.zeros(q.shape[0], hq, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(case.seq_lens[b])
        if n == 0:
            continue
        k = stored_keys(case, b, n).repeat_interleave(hq // h, dim=1)  # [n, Hq, D]
        eps = (U + d * 2.0 ** -24) * (q[b].abs()[None] * k.abs()).sum(-1) \
            + 2.0 ** -126 * (q[b].abs().sum(-1)[None] + k.abs().sum(-1) + d)
        out[b] = eps.amax(0)
    return out


def check_within_bound(cc: CheckCase):
    skip_unless_kernel_reads(cc.k_codec, cc.v_codec)
    case = cc.build()
    exact_params = cc.params()
    args = (case.q_decode, case.layer, case.block_tables, case.seq_lens)
    exact = cpu.decode_attention(*args, exact_params)
    approx = cpu.decode_attention(*args, replace(exact_params, bf16_dots=True))
    if not takes_bf16_path(CODECS[cc.k_codec]):  # no bf16 path: the exact computation, bit for bit
        assert torch.equal(approx, exact), cc.label
        return
    assert not torch.equal(approx, exact), f"{cc.label}: the bf16 path was not taken"
    ref = reference.decode_attention(*args, exact_params)
    assert_within_score_bound(cc.label, case, approx, ref, score_error_bound(case, exact_params))


@pytest.mark.parametrize("k,v", all_pairs())
def test_bf16_dots_within_derived_bound(k, v):
    check_within_bound(CheckCase(k, v, seq_lens=(45, 1, 70), num_kv_heads=2, group=3, head_dim=64))


SETTINGS = [
    dict(group=1),
    dict(group=8, num_kv_heads=1),
    dict(group=3, head_dim=96),
    dict(group=8, head_dim=128, num_kv_heads=1),
    dict(group=2, head_dim=80),  # 64 + 16 dims: a last half vector against zero-padded q
    dict(group=3, head_dim=32),
    dict(group=3, head_dim=16),  # one half vector per token
    dict(sinks=True, group=3),
    dict(sliding_window=23, group=3),
    dict(soft_cap=5.0, group=3),
    dict(transform=True, group=3),  # k_mult, k_centre (the bias), v_centre
    dict(centre=True, k_offset=4.0, group=3),
    dict(block_size=24, group=3, seq_lens=(1, 2, 3, 4, 5, 77)),  # odd tails of the 4-token passes
]


@pytest.mark.parametrize("k", ["fp8", "bf16"])
@pytest.mark.parametrize("extra", SETTINGS, ids=lambda e: ",".join(f"{a}={b}" for a, b in e.items()))
def test_bf16_dots_settings_within_bound(k, extra):
    base = dict(seq_lens=(45, 1, 70), num_kv_heads=2, seed=3)
    base.update(extra)
    head_dim = base.get("head_dim", 64)
    v = "turbo3" if head_dim % 32 == 0 and head_dim >= 32 else "bf16"
    check_within_bound(CheckCase(k, v, **base))


@pytest.mark.parametrize("k", ["turbo3", "q8_0", "fp8_e5m2", "nvfp4"])
def test_bf16_dots_other_keys_exact_with_settings(k):
    """K codecs without the bf16 path compute exactly under the setting, whatever the settings."""
    for extra in (dict(group=8, num_kv_heads=1, sinks=True),
                  dict(group=3, num_kv_heads=2, sliding_window=20, soft_cap=4.0)):
        check_within_bound(CheckCase(k, "turbo4", seq_lens=(45, 1, 70), **extra))


def simulated_bf16_decode(case, params) -> torch.Tensor:
    """Decode attention computed in float64 with the bf16 path's one rounding (q to bf16, as the
    kernel rounds it): [B, Hq, D] in the output basis (no transform, sinks, window or cap)."""
    qb = kernel_query(case, params).to(torch.bfloat16).double()  # round to nearest even, as vcvtne2ps2bf16
    return simulated_decode(case, qb, lambda b, n: stored_keys(case, b, n))


@pytest.mark.parametrize("k", sorted({f.k.name for f in all_formats()}))
def test_bf16_dots_match_simulated_bf16_arithmetic(k):
    if not takes_bf16_path(CODECS[k]):
        pytest.skip(f"{k}: no bf16 path here (exact scores, tested above)")
    for head_dim, group in ((64, 3), (96, 8), (80, 1)):
        cc = CheckCase(k, "bf16", seq_lens=(45, 1, 70), num_kv_heads=2, group=group, head_dim=head_dim)
        case = cc.build()
        params = cc.params()
        approx = cpu.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens,
                                      replace(params, bf16_dots=True))
        assert_matches_simulation(cc.label, case, approx, simulated_bf16_decode(case, params), 2e-5, "bf16 path")


def test_bf16_dots_with_int8_scores():
    """Both settings: table-code keys take the integer path, E4M3 keys the bf16 path, each the
    same bits as with its own setting alone."""
    for k in ("turbo3", "fp8"):
        cc = CheckCase(k, "turbo3", seq_lens=(45, 1, 70), num_kv_heads=2, group=3)
        case = cc.build()
        p = cc.params()
        args = (case.q_decode, case.layer, case.block_tables, case.seq_lens)
        both = cpu.decode_attention(*args, replace(p, int8_scores=True, bf16_dots=True))
        alone = cpu.decode_attention(*args, replace(p, int8_scores=True) if k == "turbo3"
                                     else replace(p, bf16_dots=True))
        assert torch.equal(both, alone), k


def test_bf16_dots_is_off_by_default_and_validated():
    assert_switch_off_by_default_and_validated("bf16_dots", "fp8", "bf16_dots must be True or False")
