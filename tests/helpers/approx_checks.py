"""What the tests of the CPU kernel's approximate decode paths share (test_cpu_int8.py: integer
scores, test_cpu_int8_values.py: integer P.V, test_cpu_bf16_decode.py: bf16 scores): the skip for
pairs the kernel does not read, the output bound that follows from a per-score error bound, the
float64 decode that the simulated arithmetic of each path plugs its rounded query and keys into,
the 7-bit level images and stored codes / scales the integer paths' oracles start from, and the
check that a path's switch is off by default and validated."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pytest
import torch

from pagedkv.codecs import packing, wht
from pagedkv.codecs.catalogue import CODECS, ScaleType
from pagedkv.codecs.floats import from_e4m3_bytes, from_half_bytes
from pagedkv.codecs.layout import block_views
from pagedkv.ops import transform
from pagedkv.ops.reference.attention import gather_rows


def skip_unless_kernel_reads(k: str, v: str) -> None:
    """Skip a pair the dispatcher hands to the reference ops (the CPU kernel does not read it)."""
    from pagedkv.ops.cpu.attention import ATTENTION_SUPPORT

    why = ATTENTION_SUPPORT.refusal(CODECS[k], store=False) or ATTENTION_SUPPORT.refusal(CODECS[v], store=False)
    if why is not None:
        pytest.skip(f"the CPU kernel does not read {k}/{v}: {why}")


def v_norm_max(case) -> torch.Tensor:
    """max_j |v_j|_2 per (sequence, kv head) of the stored values (the output's basis): [B, H]."""
    return torch.stack([v.norm(dim=-1).amax(0) if v.shape[0] else torch.zeros(v.shape[1], dtype=v.dtype)
                        for v in case.v_deq]).double()


def assert_within_score_bound(label: str, case, approx: torch.Tensor, ref: torch.Tensor, eps: torch.Tensor) -> None:
    """Scores within eps [B, Hq] move each softmax weight by a factor within exp(+-2 eps), so
    |out - ref| <= (exp(2 eps) - 1) max_j |v_j|_2, plus the exact path's summation-order allowance."""
    g = case.num_q_heads // case.layer.num_kv_heads
    vmax = v_norm_max(case).repeat_interleave(g, dim=1)  # [B, Hq]
    rms_v = torch.cat([x.reshape(-1) for x in case.v_deq]).pow(2).mean().sqrt()
    tol = torch.expm1(2 * eps) * vmax + 2e-4 * rms_v
    err = (approx.double() - ref.double()).abs().amax(-1)  # [B, Hq]
    assert bool((err <= tol).all()), f"{label}: err {err.max():.3g} > tol {tol[err > tol].min():.3g}"


def simulated_decode(case, q: torch.Tensor, keys: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """Decode attention in float64 of the query q [B, Hq, D] (as the path rounds it, in the kernel's
    basis) against keys(b, n) [n, H, D] (as the path reads them): softmax, the stored values, the
    output basis (un-rotated V). No transform, sinks, window or cap. Returns [B, Hq, D]."""
    layer = case.layer
    h, d = layer.num_kv_heads, layer.head_dim
    b_, hq, _ = q.shape
    out = torch.zeros(b_, hq, d, dtype=torch.float64)
    for b in range(b_):
        n = int(case.seq_lens[b])
        if n == 0:
            continue
        k = keys(b, n).repeat_interleave(hq // h, dim=1)  # [n, Hq, D]
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k), dim=-1)
        v = gather_rows(layer, layer.v_codec, layer.v_pool, layer.v_scale, case.block_tables[b], n).double()
        o = torch.einsum("hn,nhd->hd", w, v.repeat_interleave(hq // h, dim=1))
        out[b] = wht.unrotate(o.float()).double() if layer.v_codec.rotated else o
    return out


def level_unit(codec) -> float:
    """ls: the value of one unit of the integer paths' 7-bit level image (attention_i8.h i8_levels):
    1 for integer levels within +-63, else max|level| / 63."""
    levels = codec.value_table().double().reshape(-1)
    amax = float(levels.abs().max())
    return 1.0 if bool((levels == levels.round()).all()) and amax <= 63 else amax / 63


def level_ints(codec) -> torch.Tensor:
    """float64 [2**bits]: each code level's 7-bit image minus the offset, round(level / ls) in [-63, 63]."""
    return (codec.value_table().double().reshape(-1) / level_unit(codec)).round().clamp(-63, 63)


def level_image(codec) -> torch.Tensor:
    """float64 [2**bits]: each code level as the integer paths round it (7-bit integer x ls)."""
    return level_ints(codec) * level_unit(codec)


def stored_codes_scales(case, side: str, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n stored rows of sequence b on side "k" or "v": codes (int64 [n, H, D]) and the
    decoded group scales (float64 [n, H, D / group])."""
    layer = case.layer
    codec = layer.k_codec if side == "k" else layer.v_codec
    pool = layer.k_pool if side == "k" else layer.v_pool
    h, d, bs = layer.num_kv_heads, layer.head_dim, layer.block_size
    data, scales = block_views(codec, pool, bs, h, d)
    ids = case.block_tables[b][: -(-n // bs)].long()
    rows = data[ids].reshape(-1, h, data.shape[-1])[:n]
    srows = scales[ids].reshape(-1, h, scales.shape[-1])[:n]
    sc = from_e4m3_bytes(srows) if codec.scale_type is ScaleType.FP8_E4M3 else \
        from_half_bytes(srows, torch.bfloat16 if codec.scale_type is ScaleType.BF16 else torch.float16)
    return packing.unpack(rows, codec.code_bits, d).long(), sc.double()


def integer_keys(case, b: int, n: int) -> torch.Tensor:
    """The keys as the integer score path reads them (level images times the stored group scales):
    float64 [n, H, D]."""
    codec, d = case.layer.k_codec, case.layer.head_dim
    codes, sc = stored_codes_scales(case, "k", b, n)
    g = codec.traits.group
    return (level_image(codec)[codes].reshape(n, -1, d // g, g) * sc.reshape(n, -1, d // g, 1)).reshape(n, -1, d)


def kernel_basis_query(case, params) -> torch.Tensor:
    """q as the kernel dots it: [B, Hq, D] float64 (transform, rotation, scale)."""
    qk = transform.query_for_keys(case.layer, case.q_decode).float()
    return (wht.rotate(qk) if case.layer.k_codec.rotated else qk).double() * params.scale


def integer_query(case, params) -> torch.Tensor:
    """The query as the integer score path rounds it: round(q / sq) * sq, sq = max|q| / 127 per
    vector (kernel basis): float64 [B, Hq, D]."""
    qk = kernel_basis_query(case, params)
    sq = qk.abs().amax(-1, keepdim=True) / 127
    return (qk / sq).round().clamp(-127, 127) * sq


def assert_switch_off_by_default_and_validated(name: str, k: str = "turbo3", v: str = "turbo3") -> None:
    """AttentionParams.<name> (an approximate path's switch) is False by default, and a non-bool
    value is refused by the public op with an InvalidInput naming the switch and the value."""
    from helpers.backend_check import CheckCase

    from pagedkv import ops
    from pagedkv.errors import InvalidInput
    from pagedkv.ops import AttentionParams

    assert getattr(AttentionParams(scale=1.0), name) is False
    cc = CheckCase(k, v, seq_lens=(20,))
    case = cc.build()
    with pytest.raises(InvalidInput, match=f"{name} must be True or False, got 'yes'"):
        ops.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens,
                             replace(cc.params(), **{name: "yes"}))
