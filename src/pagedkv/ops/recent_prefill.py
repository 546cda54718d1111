"""Prefill with a recent window, split: the C kernel over the pages and over the tail's band, merged by log-sum-exp.

`recent.py`'s fast path decodes every page row of a sequence into fp32 in torch and runs one
masked `scaled_dot_product_attention` per block of 128 queries over keys concatenated from the
pages and the tail: at 8k tokens a layer's prefill took about twice the C kernel's over the
pages alone. The keys a query at position p reads are three disjoint ranges (R recent tokens,
S sinks, optional sliding window W), each a plain causal attention the C kernel (`ops.cpu`, which
returns each row's log-sum-exp) or a few torch rows compute:
- the band, keys p - R < j <= p (and j > p - W): one kernel call over the tail, every query,
  sliding window min(R, W);
- the pages, keys S <= j <= p - R (and j > p - W): one kernel call over the pages for the
  queries with p - R >= S, each placed at p - R (seq_lens n - R, bottom-right aligned as before),
  `key_start` S, sliding window W - R (none when W <= R: a query then reads only the band);
- the sinks not in the band, keys j < S, j <= p - R (and j > p - W): torch, over the <= S rows
  of the tail's first blocks.
Each part is normalised within its own keys (value centres included), so the merge
o = sum_i e^{l_i} o_i / sum_i e^{l_i} is the softmax over their union: the reference's
arithmetic up to fp32 rounding (tests/test_ops_recent.py). Applies (`split_prefill_applies`)
where the automatic prefill backend of both the pages and the tail is the C kernel, without
sparse V (its threshold is on the merged weights) or sink logits (a row may have no pages part
to carry them); elsewhere `recent.py`'s paths run.
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import AttentionParams, PagedLayer
from .dispatch import Op, select_backend
from .recent_decode import _merge, original_basis, sink_blocks
from .reference.attention import gather_rows


def split_prefill_applies(layer: PagedLayer, tail: PagedLayer, params: AttentionParams) -> bool:
    """The split prefill computes these cases exactly, with the C kernel loaded for both layers."""
    from . import cpu

    if params.sparse_v_threshold > 0 or params.sinks is not None or not cpu.available():
        return False
    return all(select_backend(Op.PREFILL, x.device, x, params).name == "cpu" for x in (layer, tail))


def _kernel(q: torch.Tensor, layer: PagedLayer, tables: torch.Tensor, lens: torch.Tensor, qsl: torch.Tensor,
            params: AttentionParams, key_start: int = 0) -> tuple:
    from . import cpu

    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32)
    out = cpu.attention(q, layer, tables, lens.to(torch.int32).contiguous(), qsl.to(torch.int32).contiguous(),
                        params, lse=lse, key_start=key_start)
    return out.float(), lse


def _pages_part(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor, n: torch.Tensor,
                qsl: torch.Tensor, params: AttentionParams, recent: int, sinks: int) -> tuple:
    """(out [Tq, Hq, D], lse [Tq, Hq]) over keys S <= j <= p - R (-inf / 0 for rows without any)."""
    tq, hq, d = q.shape
    out = torch.zeros(tq, hq, d, dtype=torch.float32)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32)
    w = params.sliding_window
    if w is not None and w <= recent:
        return out, lse
    q_lens = qsl[1:] - qsl[:-1]
    count = torch.minimum(q_lens, (n - recent - sinks).clamp(min=0))  # the last `count` queries of each sequence
    keep = count > 0
    if not bool(keep.any()):
        return out, lse
    rows = torch.cat([torch.arange(int(e) - int(c), int(e)) for e, c in zip(qsl[1:][keep], count[keep])])
    sub_qsl = torch.zeros(int(keep.sum()) + 1, dtype=torch.int64)
    sub_qsl[1:] = torch.cumsum(count[keep], 0)
    shifted = dataclasses.replace(params, sliding_window=None if w is None else w - recent)
    o, s = _kernel(q[rows].contiguous(), layer, block_tables[keep], n[keep] - recent, sub_qsl, shifted, sinks)
    out[rows], lse[rows] = o, s
    return out, lse


def _sinks_part(q: torch.Tensor, tail: PagedLayer, tables: torch.Tensor, n: torch.Tensor, qsl: torch.Tensor,
                params: AttentionParams, recent: int, sinks: int) -> tuple:
    """(out [Tq, Hq, D], lse [Tq, Hq]) over the sink keys outside the band: j < S, j <= p - R,
    j > p - W, in torch from the tail's first blocks."""
    tq, hq, d = q.shape
    h = tail.num_kv_heads
    out = torch.zeros(tq, hq, d, dtype=torch.float32)
    lse = torch.full((tq, hq), float("-inf"), dtype=torch.float32)
    w = params.sliding_window
    for b, (a, e, length) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), n.tolist())):
        a = max(a, e - (length - recent))  # queries at p >= R: the first that may see a sink outside the band
        s_rows = min(sinks, length)
        if e <= a or s_rows <= 0:
            continue
        blocks = tables[b, :sink_blocks(s_rows, tail.block_size)]
        kv = tuple(gather_rows(tail, c, pool, scale, blocks, s_rows) for c, pool, scale in
                   ((tail.k_codec, tail.k_pool, tail.k_scale), (tail.v_codec, tail.v_pool, tail.v_scale)))
        k, v = original_basis(tail, kv)  # [S, H, D]
        pos = torch.arange(length - (e - a), length)[:, None]  # [t, 1]
        j = torch.arange(s_rows)[None, :]
        visible = (j <= pos - recent) & (True if w is None else j > pos - w)  # [t, S]
        qq = q[a:e].float().view(e - a, h, hq // h, d)
        s = torch.einsum("thgd,shd->thgs", qq, k) * params.scale
        if params.soft_cap is not None:
            s = params.soft_cap * torch.tanh(s / params.soft_cap)
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        part = torch.logsumexp(s, -1)  # [t, H, G]
        p = torch.exp(s - torch.where(torch.isfinite(part), part, 0.0)[..., None])
        out[a:e] = torch.einsum("thgs,shd->thgd", p, v).reshape(e - a, hq, d)
        lse[a:e] = part.reshape(e - a, hq)
    return out, lse


def split_prefill(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, tail_tables: torch.Tensor,
                  params: AttentionParams, recent: int, sinks: int) -> torch.Tensor:
    """Packed prefill attention of q float [Tq, Hq, D] (inputs validated by the caller; query j of
    sequence b at seq_lens[b] - q_len_b + j) with keys p - R < j <= p and j < S read from `tail`
    through `tail_tables`, the others from `layer`'s pages (module doc). Returns float32 [Tq, Hq, D]."""
    qf = q.float().contiguous()
    n, qsl = seq_lens.long().cpu(), query_start_loc.long().cpu()
    w = params.sliding_window
    band = dataclasses.replace(params, sliding_window=recent if w is None else min(recent, w))
    parts = [_kernel(qf, tail, tail_tables, n, qsl, band),
             _pages_part(qf, layer, block_tables, n, qsl, params, recent, sinks)]
    if sinks:
        parts.append(_sinks_part(qf, tail, tail_tables, n, qsl, params, recent, sinks))
    return _merge(parts)
