"""Oracles and case builders for the attention ops, shared by every backend's tests.

- `make_case(...)`: random K/V for a ragged batch, stored through a shuffled block table with
  `pagedkv.ops.store`; keeps the unquantized K/V and the dequantized K/V (codec round trip of
  the same rows, independent of the pool layout and of the gather code).
- `oracle_attention(...)`: fp64 attention of one sequence over given K/V; torch SDPA when the
  case has no soft-cap / sinks / sparse-V, else plain math (sinks as an extra softmax column).
- `oracle_outputs(case, ...)`: decode / prefill outputs of a whole case from the oracle.
- `expected_error_rms(...)`: the output error a codec's measured error predicts (first order):
  V error sum_j p_j e_j and K error sum_j p_j ds_j (v_j - o), with e, ds from the NMSE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from pagedkv.codecs import reference as codec_ref
from pagedkv.codecs.catalogue import Codec, ScaleType
from pagedkv.ops import AttentionParams, PagedLayer, make_layer
from pagedkv.ops import api


@dataclass
class Case:
    """One batch of sequences stored in a layer.

    k, v: per sequence float32 [n_b, H, D] as given to store (keys include the centre).
    k_deq, v_deq: the same after the codec round trip (float64, original basis, the layer's
    transform undone: k_deq = (roundtrip(k * k_mult - k_centre) + k_centre) / k_mult,
    v_deq = roundtrip(v - v_centre) + v_centre).
    q_decode: float32 [B, Hq, D] (query at position n_b - 1).
    q_prefill: float32 [Tq, Hq, D] packed; query_start_loc int32 [B+1]; q_lens per sequence.
    """

    layer: PagedLayer
    k: list
    v: list
    k_deq: list
    v_deq: list
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_decode: torch.Tensor
    q_prefill: torch.Tensor
    query_start_loc: torch.Tensor
    q_lens: list
    num_q_heads: int

    @property
    def batch(self) -> int:
        return len(self.k)


def _tensor_scale(codec: Codec, scale: float) -> Optional[float]:
    return scale if codec.scale_type is ScaleType.TENSOR_FP32 else None


def make_case(k_codec: Codec, v_codec: Codec, *, seq_lens: Sequence[int], q_lens: Optional[Sequence[int]] = None,
              num_kv_heads: int = 2, group: int = 1, head_dim: int = 64, block_size: int = 16,
              k_offset: float = 0.0, centre: bool = False, k_scale: float = 1.0, v_scale: float = 1.0,
              q_scale: float = 1.0, seed: int = 0, spare_blocks: int = 3, store_backend="reference",
              transform: bool = False, device: torch.device | str = "cpu") -> Case:
    """Random K/V for `seq_lens` stored through shuffled block tables (plus padding slots -1).

    k_offset: magnitude of a per-head constant added to every key (real keys have a large mean);
    centre: set layer.k_centre to the mean key per head (stored keys become k - centre).
    q_lens: prefill query counts per sequence (default min(n, 5)).
    transform: give the data what the per-layer transform is for (per-channel key scales spread
    over ~e^+-1, a value offset per head) and set layer.k_mult (the inverse key scales),
    layer.k_centre (the mean multiplied key) and layer.v_centre (the mean value); drawn from
    their own generator, so the other draws of a seed do not change.
    device: where the layer, tables and queries live (the unquantized K/V stay on the CPU).
    store_backend: backend of the store (default the reference; None = automatic dispatch).
    """
    gen = torch.Generator().manual_seed(seed)
    h, d, bs = num_kv_heads, head_dim, block_size
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    width = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        tables[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    offset = k_offset * torch.randn(h, d, generator=gen)
    ks = [torch.randn(n, h, d, generator=gen) + offset for n in seq_lens]
    vs = [torch.randn(n, h, d, generator=gen) for n in seq_lens]
    k_centre = k_mult = v_centre = None
    if transform:
        tgen = torch.Generator().manual_seed(10_000 + seed)
        spread = torch.exp(torch.randn(h, d, generator=tgen))
        v_offset = 3.0 * torch.randn(h, d, generator=tgen)
        ks = [kb * spread + 2.0 * spread * torch.randn(h, d, generator=tgen) for kb in ks]
        vs = [vb + v_offset for vb in vs]
        k_mult = 1.0 / spread
        k_centre = torch.cat([kb * k_mult for kb in ks]).mean(0) if sum(seq_lens) else torch.zeros(h, d)
        v_centre = torch.cat(vs).mean(0) if sum(seq_lens) else torch.zeros(h, d)
    elif centre:
        k_centre = torch.cat(ks).mean(0) if sum(seq_lens) else torch.zeros(h, d)
    layer = make_layer(k_codec, v_codec, num_blocks, bs, h, d, k_scale=k_scale, v_scale=v_scale,
                       k_centre=k_centre, k_mult=k_mult, v_centre=v_centre, device=device)

    # One store call for the whole batch, with padding rows (slot -1) between sequences.
    rows_k, rows_v, slots = [], [], []
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slot = tables[b, pos // bs].long() * bs + pos % bs
        rows_k += [ks[b], torch.full((1, h, d), 1e4)]
        rows_v += [vs[b], torch.full((1, h, d), -1e4)]
        slots += [slot, torch.tensor([-1])]
    api.store(layer, torch.cat(rows_k).to(device), torch.cat(rows_v).to(device), torch.cat(slots).to(device),
              backend=store_backend)

    c = torch.zeros(h, d) if k_centre is None else k_centre
    m = torch.ones(h, d) if k_mult is None else k_mult
    vc = torch.zeros(h, d) if v_centre is None else v_centre
    k_deq = [(codec_ref.roundtrip(k_codec, kb * m - c, _tensor_scale(k_codec, k_scale)).double() + c.double())
             / m.double() for kb in ks]
    v_deq = [codec_ref.roundtrip(v_codec, vb - vc, _tensor_scale(v_codec, v_scale)).double() + vc.double()
             for vb in vs]

    hq = h * group
    q_decode = q_scale * torch.randn(len(seq_lens), hq, d, generator=gen)
    q_lens = [min(n, 5) for n in seq_lens] if q_lens is None else list(q_lens)
    q_prefill = q_scale * torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    return Case(layer, ks, vs, k_deq, v_deq, tables.to(device), lens.to(device), q_decode.to(device),
                q_prefill.to(device), qsl.to(device), q_lens, hq)


def oracle_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     params: AttentionParams, return_weights: bool = False):
    """fp64 attention of one sequence: q [Tq, Hq, D], k/v [n, H, D] (original basis).

    Returns out float64 [Tq, Hq, D] (and weights [Hq, Tq, n] if asked).
    """
    q, k, v, q_pos = q.cpu().double(), k.cpu().double(), v.cpu().double(), q_pos.cpu()
    tq, hq, d = q.shape
    n, h = k.shape[0], k.shape[1]
    kk = k.repeat_interleave(hq // h, dim=1).transpose(0, 1)  # [Hq, n, D]
    vv = v.repeat_interleave(hq // h, dim=1).transpose(0, 1)
    qq = q.transpose(0, 1)  # [Hq, Tq, D]
    key_pos = torch.arange(n)
    mask = key_pos[None, :] <= q_pos[:, None]
    if params.sliding_window is not None:
        mask &= key_pos[None, :] > q_pos[:, None] - params.sliding_window
    plain = params.soft_cap is None and params.sinks is None and params.sparse_v_threshold == 0
    if plain and not return_weights:
        out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=params.scale)
        return out.transpose(0, 1)
    s = (qq @ kk.transpose(1, 2)) * params.scale
    if params.soft_cap is not None:
        s = params.soft_cap * torch.tanh(s / params.soft_cap)
    s = s.masked_fill(~mask, float("-inf"))
    if params.sinks is not None:
        sink_col = params.sinks.cpu().double()[:, None, None].expand(hq, tq, 1)
        p = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :n]
    else:
        p = torch.softmax(s, dim=-1)
    if params.sparse_v_threshold > 0:
        p = p * (p >= params.sparse_v_threshold)
    out = (p @ vv).transpose(0, 1)
    return (out, p) if return_weights else out


def decode_positions(case: Case):
    return [torch.tensor([n - 1]) for n in case.seq_lens.tolist()]


def prefill_positions(case: Case):
    return [torch.arange(n - ql, n) for n, ql in zip(case.seq_lens.tolist(), case.q_lens)]


def oracle_outputs(case: Case, params: AttentionParams, *, mode: str, quantized: bool = True) -> torch.Tensor:
    """fp64 decode ([B, Hq, D]) or prefill ([Tq, Hq, D]) outputs of the oracle for a case.

    quantized=True attends over the dequantized K/V (what the cache holds), else the originals.
    """
    ks, vs = (case.k_deq, case.v_deq) if quantized else (case.k, case.v)
    if mode == "decode":
        outs = []
        for b, pos in enumerate(decode_positions(case)):
            if case.seq_lens[b] == 0:
                outs.append(torch.zeros(1, case.num_q_heads, case.layer.head_dim, dtype=torch.float64))
                continue
            outs.append(oracle_attention(case.q_decode[b : b + 1], ks[b], vs[b], pos, params))
        return torch.cat(outs)
    outs = []
    starts = case.query_start_loc.tolist()
    for b, pos in enumerate(prefill_positions(case)):
        outs.append(oracle_attention(case.q_prefill[starts[b] : starts[b + 1]], ks[b], vs[b], pos, params))
    return torch.cat(outs)


def run_op(case: Case, params: AttentionParams, *, mode: str, backend="reference", fn=None) -> torch.Tensor:
    """Run decode or prefill on a case through the public op (or through `fn`, same signature).

    backend: passed to the public op; the reference by default, None = automatic dispatch.
    """
    if mode == "decode":
        f = fn or (lambda *a: api.decode_attention(*a, backend=backend))
        return f(case.q_decode, case.layer, case.block_tables, case.seq_lens, params)
    f = fn or (lambda *a: api.prefill_attention(*a, backend=backend))
    return f(case.q_prefill, case.layer, case.block_tables, case.seq_lens, case.query_start_loc, params)


def expected_error_rms(case: Case, params: AttentionParams, *, mode: str) -> float:
    """RMS output error (per element) predicted from the codecs' error measured on this case.

    First order, with iid per-element errors of the measured mean square (in the original
    basis: the codec's NMSE times the mean square of what was stored, mapped back through the
    layer's transform): a K error moves logit j by ds_j = scale * q . e_kj (variance
    scale^2 |q|^2 ms(e_k)) and the output by sum_j p_j ds_j (v_j - o); a V error moves it by
    sum_j p_j e_vj. Independent errors add in quadrature.
    """
    layer = case.layer
    ms_err_k = _mean_square_error(case.k, case.k_deq)
    ms_err_v = _mean_square_error(case.v, case.v_deq)
    total, count = 0.0, 0
    positions = decode_positions(case) if mode == "decode" else prefill_positions(case)
    starts = case.query_start_loc.tolist()
    for b, pos in enumerate(positions):
        n = int(case.seq_lens[b])
        if n == 0:
            continue
        q = case.q_decode[b : b + 1] if mode == "decode" else case.q_prefill[starts[b] : starts[b + 1]]
        exact_params = AttentionParams(scale=params.scale, sliding_window=params.sliding_window,
                                       soft_cap=params.soft_cap, sinks=params.sinks)
        out, p = oracle_attention(q, case.k[b], case.v[b], pos, exact_params, return_weights=True)
        hq = q.shape[1]
        vv = case.v[b].double().repeat_interleave(hq // layer.num_kv_heads, dim=1).transpose(0, 1)  # [Hq, n, D]
        spread = ((vv[:, None, :, :] - out.transpose(0, 1)[:, :, None, :]) ** 2).mean(-1)  # [Hq, Tq, n]
        q2 = (q.cpu().double() ** 2).sum(-1).transpose(0, 1)  # [Hq, Tq]
        var_s = params.scale ** 2 * q2 * ms_err_k  # logit error variance
        e_k = var_s * (p ** 2 * spread).sum(-1)
        e_v = ms_err_v * (p ** 2).sum(-1)
        total += float((e_k + e_v).sum())
        count += e_k.numel()
    return (total / max(count, 1)) ** 0.5


def _mean_square_error(exact: list, deq: list) -> float:
    err = sum(float(((d - e.double()) ** 2).sum()) for e, d in zip(exact, deq))
    return err / max(sum(e.numel() for e in exact), 1)


def sparse_interval(case: Case, params: AttentionParams, *, mode: str):
    """Where a sparse-V output may sit relative to the reference's: (lo, hi) float64 [rows, Hq, D].

    The reference drops the set S of positions with exact weight p_j < t; a fast path may drop
    any subset of S, so o_fast - o_ref = sum over the kept part of S of p_j v_j, which lies
    elementwise in [sum_S min(0, p_j v_j), sum_S max(0, p_j v_j)]. With a value centre c only
    the stored residual v_j - c is dropped (c enters with the weights' full sum), so v_j - c
    stands for v_j there.
    """
    t = params.sparse_v_threshold
    exact = AttentionParams(scale=params.scale, sliding_window=params.sliding_window,
                            soft_cap=params.soft_cap, sinks=params.sinks)
    positions = decode_positions(case) if mode == "decode" else prefill_positions(case)
    starts = case.query_start_loc.tolist()
    lo, hi = [], []
    for b, pos in enumerate(positions):
        q = case.q_decode[b : b + 1] if mode == "decode" else case.q_prefill[starts[b] : starts[b + 1]]
        zeros = torch.zeros(q.shape[0], q.shape[1], case.layer.head_dim, dtype=torch.float64)
        if int(case.seq_lens[b]) == 0 or t == 0:
            lo.append(zeros)
            hi.append(zeros)
            continue
        _, p = oracle_attention(q, case.k_deq[b], case.v_deq[b], pos, exact, return_weights=True)
        dropped = p * (p < t)  # [Hq, Tq, n]
        vc = 0.0 if case.layer.v_centre is None else case.layer.v_centre.cpu().double()
        vv = (case.v_deq[b] - vc).repeat_interleave(q.shape[1] // case.layer.num_kv_heads, dim=1).transpose(0, 1)  # [Hq, n, D]
        lo.append((dropped @ vv.clamp(max=0)).transpose(0, 1))
        hi.append((dropped @ vv.clamp(min=0)).transpose(0, 1))
    return torch.cat(lo), torch.cat(hi)


def rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())
