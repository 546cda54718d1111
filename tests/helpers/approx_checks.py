"""What the tests of the CPU kernel's approximate decode paths share (test_cpu_int8.py: integer
scores, test_cpu_bf16_decode.py: bf16 scores): the skip for pairs the kernel does not read, the
output bound that follows from a per-score error bound, and the float64 decode that the simulated
arithmetic of each path plugs its rounded query and keys into."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from pagedkv.codecs import wht
from pagedkv.codecs.catalogue import CODECS
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


def assert_matches_simulation(label: str, case, got: torch.Tensor, oracle: torch.Tensor, rel: float, what: str) -> None:
    """The kernel's output `got` within rel * rms(v) of the float64 simulation of its path's
    roundings `oracle` (what is left is summation order)."""
    rms_v = torch.cat([x.reshape(-1) for x in case.v_deq]).pow(2).mean().sqrt()
    err = float((got.double() - oracle).abs().max())
    assert err < rel * float(rms_v), f"{label}: |kernel - simulated {what}| = {err:.3g}"


def assert_switch_off_by_default_and_validated(name: str, k: str, match: str) -> None:
    """AttentionParams.<name> is False by default, and a non-bool value is refused by the ops
    (InvalidInput matching `match`) on a `k`-keyed layer."""
    from dataclasses import replace

    from helpers.backend_check import CheckCase

    from pagedkv import ops
    from pagedkv.errors import InvalidInput
    from pagedkv.ops import AttentionParams

    assert getattr(AttentionParams(scale=1.0), name) is False
    cc = CheckCase(k, "turbo3", seq_lens=(20,))
    case = cc.build()
    with pytest.raises(InvalidInput, match=match):
        ops.decode_attention(case.q_decode, case.layer, case.block_tables, case.seq_lens,
                             replace(cc.params(), **{name: "yes"}))
