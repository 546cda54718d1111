"""Decode with a recent window, split: the C kernel over the pages and the tail, merged by log-sum-exp.

`recent.py`'s paths decode every page row of a sequence in torch at every call: O(context) torch
work per layer and decode step. In decode (one query per sequence, at position p = n - 1) the
keys a query reads are three contiguous ranges (S sinks, R recent tokens): S <= j < n - R from
the pages, j < min(S, n - R) and n - R <= j < n from the tail. Two calls of the C decode kernel
(`ops.cpu.attention`, which returns each row's log-sum-exp) read them:
- the pages: seq_lens n - R, `key_start` S;
- the tail, 2B rows: seq_lens n with a sliding window of R (keys j > n - 1 - R), and seq_lens
  min(S, n - R) (a query below R sees every key before it: the sinks not in the window);
merged by log-sum-exp: o = sum_i e^{l_i} o_i / sum_i e^{l_i}. Each part's output is normalised
within its own keys (value centres included: a part's weights sum to 1), so the merge is exact;
sink logits (`params.sinks`) join the pages' call only, once. A tail codec the kernel does not
read (f16), or S > R, is decoded in torch instead (`_tail_rows`: at most cdiv(S, bt) + cdiv(R, bt) + 1
blocks per sequence, one masked softmax). The same arithmetic as the reference up to fp32
rounding (tests/test_ops_recent.py). Applies (`split_applies`) where the automatic backend of
the pages is the C kernel, without sparse V (its threshold is on the merged weights), a sliding
window (the pages range would start per sequence) or sink logits with a value centre (the
kernel leaves that case to the reference); elsewhere `recent.py`'s paths run.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..codecs import reference as codec_ref
from ..codecs import wht
from ..codecs.layout import block_views
from .batch import AttentionParams, PagedLayer
from .dispatch import Op, select_backend
from .reference.store import tensor_scale


def sink_blocks(sinks: int, block_size: int) -> int:
    """Blocks covering the first `sinks` positions (kept by the tail for every sequence)."""
    return -(-sinks // block_size)


def original_basis(layer: PagedLayer, kv: tuple) -> tuple:
    """(k, v) float32 [..., H, D] decoded in `layer`'s stored basis -> the keys and values
    attention sees: un-rotated, plus the centres, keys divided by the key multiplier (stored
    k * m - c)."""
    k, v = kv
    if layer.k_codec.rotated:
        k = wht.unrotate(k)
    if layer.k_centre is not None:
        k = k + layer.k_centre.to(k.device, torch.float32)
    if layer.k_mult is not None:
        k = k / layer.k_mult.to(k.device, torch.float32)
    if layer.v_codec.rotated:
        v = wht.unrotate(v)
    if layer.v_centre is not None:
        v = v + layer.v_centre.to(v.device, torch.float32)
    return k, v


def split_applies(layer: PagedLayer, params: AttentionParams) -> bool:
    """The split decode computes these cases exactly, with the C kernel loaded for `layer`."""
    from . import cpu

    if params.sparse_v_threshold > 0 or params.sliding_window is not None:
        return False
    if params.sinks is not None and layer.v_centre is not None:
        return False
    return cpu.available() and _kernel_reads(layer, params)


def _kernel_reads(layer: PagedLayer, params: AttentionParams) -> bool:
    return select_backend(Op.DECODE, layer.device, layer, params).name == "cpu"


def tail_in_kernel(tail: PagedLayer, params: AttentionParams) -> bool:
    """Whether `split_decode` reads `tail`'s rows with the C kernel (its codec on its device; sink
    logits join the pages' call only). Constant over the layers of one attention group: a front
    door that runs many layers per step passes it to `split_rows` instead of a backend choice per
    call."""
    return _kernel_reads(tail, dataclasses.replace(params, sinks=None))


def _tail_rows(tail: PagedLayer, tables: torch.Tensor, n: torch.Tensor, recent: int, sinks: int):
    """The tail rows each sequence's query reads: (k, v) float32 [B, T, H, D] in the original
    basis and visible bool [B, T] (positions j < min(S, n) and max(S, n - R) <= j < n, each once)."""
    bt, dev = tail.block_size, tables.device
    ks, kr = sink_blocks(sinks, bt), -(-recent // bt) + 1
    first = (n - recent).clamp(min=0) // bt
    logical = torch.cat([torch.arange(ks, device=dev).expand(n.shape[0], ks),
                         first[:, None] + torch.arange(kr, device=dev)], 1)  # [B, K]
    width = tables.shape[1]
    ids = tables.long().gather(1, logical.clamp(max=width - 1))
    ids = torch.where(logical <= (n[:, None] - 1) // bt, ids, 0).clamp(0, tail.num_blocks - 1)
    pos = (logical[..., None] * bt + torch.arange(bt, device=dev)).flatten(1)  # [B, K * bt]
    from_sinks = torch.arange(logical.shape[1], device=dev).repeat_interleave(bt) < ks
    lo = torch.maximum(n - recent, torch.full_like(n, sinks))
    visible = torch.where(from_sinks, pos < torch.clamp(n, max=sinks)[:, None],
                          (pos >= lo[:, None]) & (pos < n[:, None]))
    h, d = tail.num_kv_heads, tail.head_dim
    out = []
    for codec, pool, scale in ((tail.k_codec, tail.k_pool, tail.k_scale), (tail.v_codec, tail.v_pool, tail.v_scale)):
        data, scales = block_views(codec, pool, bt, h, d)
        rows, rs = data[ids], scales[ids]  # [B, K, bt, H, bytes]
        x = codec_ref.decode(codec, rows, rs, d, tensor_scale(codec, scale), rotated_basis=True)
        out.append(x.reshape(n.shape[0], -1, h, d))
    k, v = original_basis(tail, tuple(out))
    # rows no query reads (released blocks, unwritten slots) may hold any bytes, NaN included:
    # a weight of 0 times NaN is NaN, so they are zeroed (their logits are masked)
    hide = ~visible[..., None, None]
    return k.masked_fill(hide, 0.0), v.masked_fill(hide, 0.0), visible


def _merge(parts: list) -> torch.Tensor:
    """[(out float32 [B, Hq, D], lse float32 [B, Hq])] -> the softmax over the union of their
    keys (a part with lse -inf has no visible key and weight 0; every row has one somewhere)."""
    w = torch.softmax(torch.stack([p[1] for p in parts]), 0)  # [P, B, Hq]: e^{l_i} / sum_j e^{l_j}
    out = parts[0][0] * w[0, ..., None]
    for i in range(1, len(parts)):
        out.addcmul_(parts[i][0], w[i, ..., None])
    return out


def _kernel_part(q: torch.Tensor, layer: PagedLayer, tables: torch.Tensor, lens: torch.Tensor,
                 params: AttentionParams, key_start: int) -> tuple:
    from . import cpu

    b, hq, _ = q.shape
    lse = torch.empty(b, hq, dtype=torch.float32)
    out = cpu.attention(q, layer, tables, lens.to(torch.int32), torch.arange(b + 1, dtype=torch.int32), params,
                        lse=lse, key_start=key_start)
    return out.float(), lse


def _torch_tail(q: torch.Tensor, tail: PagedLayer, tables: torch.Tensor, n: torch.Tensor,
                params: AttentionParams, recent: int, sinks: int) -> tuple:
    """The tail part in torch (rows from `_tail_rows`): (out float32 [B, Hq, D], lse [B, Hq])."""
    b, hq, d = q.shape
    h = tail.num_kv_heads
    k, v, visible = _tail_rows(tail, tables, n, recent, sinks)
    s = torch.einsum("bhgd,bthd->bhgt", q.view(b, h, hq // h, d), k) * params.scale
    if params.soft_cap is not None:
        s = params.soft_cap * torch.tanh(s / params.soft_cap)
    s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # [B, H, G]; -inf where the tail has no visible row
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("bhgt,bthd->bhgd", p, v).reshape(b, hq, d), lse.reshape(b, hq)


def split_decode(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, tail_tables: torch.Tensor, params: AttentionParams,
                 recent: int, sinks: int, tail_kernel: Optional[bool] = None) -> torch.Tensor:
    """Decode attention of q float [B, Hq, D] (every seq_lens[b] >= 1, inputs validated by the
    caller) with keys n - R <= j and j < S read from `tail` through `tail_tables`, the others
    from `layer`'s pages. tail_kernel: `tail_in_kernel(tail, params)` when the caller has it
    (None: decided here). Returns float32 [B, Hq, D]."""
    n = seq_lens.long()
    longest = int(n.max())  # no query reads past its length: the tail rows are built per step
    sinks, recent = min(sinks, longest), min(recent, longest)
    qf = q.float().contiguous()
    parts = [_kernel_part(qf, layer, block_tables, (n - recent).clamp(min=0), params, sinks)]
    plain = dataclasses.replace(params, sinks=None)  # sink logits: counted once, in the pages' call
    if tail_kernel is None:
        tail_kernel = _kernel_reads(tail, plain)
    if sinks <= recent and tail_kernel:
        # one call, 2B rows: keys [n - R, n) (window R), then the sinks before them, [0, min(S, n - R))
        # (a query at min(S, n - R) - 1 <= R - 1 sees them all through the window)
        b = q.shape[0]
        before = torch.minimum(n - recent, torch.full_like(n, sinks)).clamp(min=0)
        out, lse = _kernel_part(torch.cat([qf, qf]), tail, torch.cat([tail_tables, tail_tables]),
                                torch.cat([n, before]), dataclasses.replace(plain, sliding_window=recent), 0)
        parts += [(out[:b], lse[:b]), (out[b:], lse[b:])]
    else:  # a tail codec the kernel does not read, or more sinks than recent tokens
        parts.append(_torch_tail(qf, tail, tail_tables, n, params, recent, sinks))
    return _merge(parts)


@torch.no_grad()
def split_rows(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, tail_tables: torch.Tensor, params: AttentionParams,
               recent: int, sinks: int, tail_kernel: Optional[bool] = None) -> torch.Tensor:
    """`split_decode` over the rows that have a key (a length-0 row gives zeros), in q's dtype;
    inputs validated by the caller (`recent.prepare_split_decode`)."""
    keep = seq_lens > 0
    if bool(keep.all()):
        return split_decode(q, layer, tail, block_tables, seq_lens, tail_tables, params, recent, sinks,
                            tail_kernel).to(q.dtype)
    out = torch.zeros_like(q)
    if bool(keep.any()):
        out[keep] = split_decode(q[keep], layer, tail, block_tables[keep], seq_lens[keep], tail_tables[keep],
                                 params, recent, sinks, tail_kernel).to(q.dtype)
    return out
