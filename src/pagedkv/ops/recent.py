"""Attention with a high-precision recent window: the last R tokens read from a high-precision tail.

A sequence's K/V are stored twice at write time: in its format's pages (`layer`) and in a
high-precision tail (`tail`: a `PagedLayer` with the tail codec, e.g. bf16 or q8_0, at the same
slots, the same transform). A query at position p reads keys p - R < j <= p from the tail and
older keys j <= p - R from the compressed pages, in one softmax: exactly what token-by-token
decoding sees when the last R tokens are kept in high precision and a token is moved to the
compressed pages when it leaves the window (the compressed bytes are the same: they are encoded
from the same K/V; with a tail codec that is not bf16 a re-encode from the tail would add the
tail's rounding first, which this avoids). A one-pass teacher-forced prefill therefore sees what
decoding would: (p - R, p] in high precision, [0, p - R] compressed.

Storage (what `stored_tail_tokens` counts): once a token has left the window only its compressed
copy is needed, so a paged tail keeps the blocks covering the last R positions (a sliding block
group with window R); the compressed pages hold every token.

Semantics beyond the plain ops (`ops/reference/attention.py`): logits of the tail keys use the
tail layer's codecs, everything else (scale, soft-cap, causal / sliding-window mask, sinks,
sparse V, the value centre of each layer) as in the reference. This module is the reference
implementation (readable torch, one sequence in fp32 at a time, `reference=True`).

Fast path (the default where it applies: no soft-cap, no sink logits, no sparse V): both layers'
rows are decoded once into the original basis (un-rotated, centres and key multiplier applied),
and each block of QUERY_BLOCK queries runs one fused softmax (`scaled_dot_product_attention`)
over the pages keys it reads from the pages, the sink rows and the band of recent rows it reads
from the tail, concatenated, with a mask that counts every visible key once, from the source the
reference reads it from. Same arithmetic up to fp32 rounding (tests/test_ops_recent.py); it skips
the keys no query of the block sees (causal, window) and never forms the tail's logits beyond the
band, where the reference forms two full [Hq, Tq, n] logit tensors.

Decode (at most one query per sequence) on CPU runs a third path where it applies
(`recent_decode.py`): the C kernel over the pages' keys, torch over the tail's few rows, merged
by log-sum-exp, so a step no longer decodes the whole context in torch. Prefill on CPU likewise
(`recent_prefill.py`, before the fast path where it applies): the C kernel over the pages and
over the tail's band of recent keys, torch over the sinks, merged by log-sum-exp.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..codecs import wht
from ..errors import ConfigError, InvalidInput
from ..spec import MAX_WINDOW_TOKENS, RecentWindow, check_window_count as _check_count  # noqa: F401 (their old home)
from ..spec import split_window_suffix, window_from_label  # noqa: F401 (their old home)
from . import transform
from .batch import AttentionParams, PagedLayer
from .recent_decode import original_basis, sink_blocks, split_applies, split_decode, split_rows
from .recent_prefill import split_prefill, split_prefill_applies
from .reference.attention import attention_logits, gather_rows, masked_softmax, varlen_query_chunks
from .validate import check_decode, check_prefill


def stored_tail_tokens(seq_len: int, recent: int, block_size: int, sinks: int = 0) -> int:
    """Token slots of the tail blocks a paged recent window holds for a sequence of `seq_len`
    tokens: the blocks covering positions max(0, seq_len - R) .. seq_len - 1 and, with sinks,
    those covering 0 .. S - 1 (a block counted once)."""
    if seq_len <= 0:
        return 0
    last = (seq_len - 1) // block_size
    first = max(0, seq_len - recent) // block_size
    keep = min(sink_blocks(sinks, block_size), last + 1)
    return (last - max(first, keep) + 1 + keep) * block_size


def tail_tokens(recent: Optional["RecentWindow"], seq_len: int, block_size: int) -> int:
    """Token slots a window's tail holds at `seq_len` tokens (0 without a window)."""
    return 0 if recent is None else stored_tail_tokens(seq_len, recent.tokens, block_size, recent.sinks)


def _values(p: torch.Tensor, v: torch.Tensor, layer: PagedLayer, weight_sum) -> torch.Tensor:
    """sum_j p_j v_j in the original basis (+ the layer's value centre times the weight sum)."""
    hh, g, tq, _ = p.shape
    out = torch.einsum("hgtn,nhd->thgd", p, v)
    if layer.v_codec.rotated:
        out = wht.unrotate(out)
    out = out.reshape(tq, hh * g, -1)
    if layer.v_centre is not None:
        transform.add_value_centre(layer, out, weight_sum)
    return out


def attend_recent(q: torch.Tensor, kv: tuple, tail_kv: tuple, q_pos: torch.Tensor, layer: PagedLayer,
                  tail: PagedLayer, params: AttentionParams, recent: int, sinks: int = 0) -> torch.Tensor:
    """fp32 attention of one sequence: q float [Tq, Hq, D]; kv = (k, v) float32 [n, H, D] decoded
    from `layer`, tail_kv from `tail` (rows outside every query's window and the sinks may be
    anything finite); q_pos int64 [Tq]. Keys p - recent < j <= p and j < sinks are read from the
    tail. Returns float32 [Tq, Hq, D]."""
    tq, hq, _ = q.shape
    h = layer.num_kv_heads
    n = kv[0].shape[0]
    key_pos = torch.arange(n, device=q.device)
    in_tail = (key_pos[None, :] > q_pos[:, None] - recent) | (key_pos[None, :] < sinks)  # [Tq, n]
    s = torch.where(in_tail, attention_logits(q, tail_kv[0], tail), attention_logits(q, kv[0], layer))
    p = masked_softmax(s, q_pos, params, sink_shape=(h, hq // h, 1, 1))
    parts = (p * ~in_tail, p * in_tail)
    sums = [x.sum(-1).permute(2, 0, 1).reshape(tq, hq) for x in parts]
    if params.sparse_v_threshold > 0:
        parts = tuple(torch.where(p < params.sparse_v_threshold, torch.zeros_like(x), x) for x in parts)
    return (_values(parts[0], kv[1], layer, sums[0]) + _values(parts[1], tail_kv[1], tail, sums[1]))


def _rows(layer: PagedLayer, table: torch.Tensor, n: int, start: int, sinks: int = 0):
    """(k, v) float32 [n, H, D] of one sequence with rows before `start` zeroed (not decoded),
    except the blocks covering the first `sinks` rows."""
    bs = layer.block_size
    first = start // bs
    keep = min(sink_blocks(sinks, bs), first)
    out = []
    for codec, pool, scale in ((layer.k_codec, layer.k_pool, layer.k_scale),
                               (layer.v_codec, layer.v_pool, layer.v_scale)):
        x = gather_rows(layer, codec, pool, scale, table[first:], n - first * bs)
        full = torch.zeros(n, *x.shape[1:], dtype=x.dtype, device=x.device)
        full[first * bs:] = x
        if keep:
            full[:keep * bs] = gather_rows(layer, codec, pool, scale, table[:keep], keep * bs)
        out.append(full)
    return tuple(out)


def _check_tail(layer: PagedLayer, tail: PagedLayer, recent: int, own_tables: bool, sinks: int) -> None:
    _check_count("sinks", sinks, 0)
    if not isinstance(tail, PagedLayer):
        raise ConfigError(f"tail must be a PagedLayer, got {type(tail).__name__}")
    same = (tail.num_kv_heads, tail.head_dim) == (layer.num_kv_heads, layer.head_dim)
    if not own_tables:  # the same tables address both: the same block size, at least the blocks
        same = same and tail.block_size == layer.block_size and tail.num_blocks >= layer.num_blocks
    if not same:
        raise ConfigError("the tail layer must have the layer's heads and head_dim (and, without "
                          "tail_block_tables, its block size and at least its blocks)")
    _check_count("recent", recent, 1)


def _tail_tables(tail: PagedLayer, tables: Optional[torch.Tensor], block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, recent: int,
                 checks: bool, sinks: int = 0) -> torch.Tensor:
    """The tables the tail is read through: `block_tables` when `tables` is None, else the tail's
    own block tables (its block group), checked: int32 [B, >= blocks of each sequence] on the
    layer's device, ids in range for the blocks a query's window reads (and the sinks')."""
    if tables is None:
        return block_tables
    if not isinstance(tables, torch.Tensor) or tables.dtype != torch.int32 or tables.dim() != 2 \
            or tables.shape[0] != block_tables.shape[0] or tables.device != block_tables.device:
        raise InvalidInput(f"tail_block_tables must be int32 [B={block_tables.shape[0]}, max_blocks] on "
                           f"{block_tables.device}, got {getattr(tables, 'dtype', type(tables).__name__)} "
                           f"{list(getattr(tables, 'shape', []))}")
    if not checks:
        return tables
    bs = tail.block_size
    for b, (n, ql) in enumerate(zip(seq_lens.tolist(), (query_start_loc[1:] - query_start_loc[:-1]).tolist())):
        if not n:
            continue
        first, last = max(0, n - ql - recent + 1) // bs, (n - 1) // bs
        if last >= tables.shape[1]:
            raise InvalidInput(f"tail_block_tables row {b} has {tables.shape[1]} entries; sequence length "
                               f"{n} needs {last + 1}")
        keep = min(sink_blocks(sinks, bs), first)
        ids = torch.cat([tables[b, :keep], tables[b, first:last + 1]])
        if int(ids.min()) < 0 or int(ids.max()) >= tail.num_blocks:
            raise InvalidInput(f"tail_block_tables row {b} holds block ids outside [0, {tail.num_blocks}) "
                               f"for the window's blocks {first}..{last} (and the sinks' 0..{keep - 1})")
    return tables


@torch.no_grad()
def recent_prefill_attention(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, params: AttentionParams,
                             *, recent: int, checks: bool = True,
                             tail_block_tables: Optional[torch.Tensor] = None, sinks: int = 0,
                             reference: bool = False) -> torch.Tensor:
    """`prefill_attention` (same tensors and positions) with the last `recent` keys of each
    query read from `tail`: through `block_tables` (the same blocks and slots as the pages), or
    through `tail_block_tables` int32 [B, max_blocks] when the tail has its own block group
    (its block size may then differ from the pages'; only the blocks covering each query's last `recent` positions are read, so the others may
    have been released; with `sinks`, the blocks covering the first `sinks` positions too, which
    are also read from the tail). reference: always the readable oracle (`attend_recent`), not
    the fast paths (module doc; decode, at most one query per sequence, runs `recent_decode`'s
    split where it applies). Returns [Tq, Hq, D] in q's dtype."""
    _check_tail(layer, tail, recent, tail_block_tables is not None, sinks)
    check_prefill(q, layer, block_tables, seq_lens, query_start_loc, params, checks)
    tail_tables = _tail_tables(tail, tail_block_tables, block_tables, seq_lens, query_start_loc, recent, checks, sinks)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    if not reference and q.shape[0] and split_applies(layer, params) and bool((q_lens <= 1).all()):
        # decode (at most one query per sequence, at n - 1): the C kernel over the pages' keys and
        # the tail's few rows, merged by log-sum-exp (recent_decode.py)
        rows = q_lens == 1
        return split_decode(q, layer, tail, block_tables[rows], seq_lens[rows], tail_tables[rows], params,
                            recent, sinks).to(q.dtype)
    if not reference and q.shape[0] and split_prefill_applies(layer, tail, params):
        # the C kernel over the pages and over the tail's band, torch over the sinks (recent_prefill.py)
        return split_prefill(q, layer, tail, block_tables, seq_lens, query_start_loc, tail_tables, params,
                             recent, sinks).to(q.dtype)
    fast = not reference and fast_path_applies(params)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n, chunks in varlen_query_chunks(seq_lens, query_start_loc, q.shape[1], q.device):
        table = block_tables[b]
        lo_q = int(chunks[0][2][0]) if n else 0
        kv = _rows(layer, table, n, 0)
        tail_kv = _rows(tail, tail_tables[b], n, max(0, lo_q - recent + 1), sinks)
        if fast:
            kv, tail_kv = original_basis(layer, kv), original_basis(tail, tail_kv)
        for a, e, q_pos in chunks:
            if fast:
                out[a:e] = _attend_fast(q[a:e], kv, tail_kv, q_pos, params, recent, sinks)
            else:
                out[a:e] = attend_recent(q[a:e], kv, tail_kv, q_pos, layer, tail, params, recent, sinks)
    return out.to(q.dtype)


QUERY_BLOCK = 128  # queries per fused softmax of the fast path


def fast_path_applies(params: AttentionParams) -> bool:
    """The fast path computes plain softmax attention: no soft-cap, no sink logits, no sparse V."""
    return params.soft_cap is None and params.sinks is None and params.sparse_v_threshold == 0


def _attend_fast(q: torch.Tensor, kv: tuple, tail_kv: tuple, q_pos: torch.Tensor, params: AttentionParams,
                 recent: int, sinks: int) -> torch.Tensor:
    """`attend_recent` for consecutive query positions q_pos, kv / tail_kv in the original basis
    (`original_basis`), where `fast_path_applies(params)`. Returns float32 [Tq, Hq, D]."""
    tq, hq, d = q.shape
    h = kv[0].shape[1]
    w = params.sliding_window
    out = torch.empty(tq, hq, d, dtype=torch.float32, device=q.device)
    first = int(q_pos[0])
    for a in range(0, tq, QUERY_BLOCK):
        e = min(tq, a + QUERY_BLOCK)
        p0, p1 = first + a, first + e - 1
        lo = 0 if w is None else max(0, p0 - w + 1)  # no query of the block sees a key below lo
        band = max(lo, p0 - recent + 1)  # tail rows [band, p1]: every recent key of the block
        ranges = ((kv, max(lo, sinks), p1 - recent + 1, False),  # pages rows [max(lo, S), p1 - R]
                  (tail_kv, lo, min(sinks, band), True), (tail_kv, band, p1 + 1, True))
        ranges = [r for r in ranges if r[2] > r[1]]
        keys = torch.cat([src[0][s:t] for src, s, t, _ in ranges]).transpose(0, 1)  # [H, m, D]
        values = torch.cat([src[1][s:t] for src, s, t, _ in ranges]).transpose(0, 1)
        key_pos = torch.cat([torch.arange(s, t, device=q.device) for _, s, t, _ in ranges])
        from_tail = torch.cat([torch.full((t - s,), tl, device=q.device) for _, s, t, tl in ranges])
        qp = q_pos[a:e, None]
        visible = (key_pos[None, :] <= qp) & (True if w is None else key_pos[None, :] > qp - w)
        in_tail = (key_pos[None, :] > qp - recent) | (key_pos[None, :] < sinks)
        mask = visible & (in_tail == from_tail[None, :])
        g = hq // h
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:e].float().transpose(0, 1)[None], keys.repeat_interleave(g, 0)[None],
            values.repeat_interleave(g, 0)[None], attn_mask=mask, scale=params.scale)
        out[a:e] = o[0].transpose(0, 1)
    return out


def prepare_split_decode(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, params: AttentionParams, *, recent: int, checks: bool = True,
                         tail_block_tables: Optional[torch.Tensor] = None, sinks: int = 0) -> Optional[torch.Tensor]:
    """Where the split decode (`recent_decode.py`) runs `recent_decode_attention`'s arguments:
    validated (as that op validates them), the tables the tail is read through; else None (no
    row, or a case the split does not compute: the op's other paths run). A front door that calls
    the op for many layers of one step over the same tables (vLLM's attention group) validates
    once with this and calls `split_rows` for the others."""
    if not q.shape[0] or not split_applies(layer, params):
        return None
    _check_tail(layer, tail, recent, tail_block_tables is not None, sinks)
    check_decode(q, layer, block_tables, seq_lens, params, checks)
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)  # a query per row (empty rows: skipped)
    return _tail_tables(tail, tail_block_tables, block_tables, seq_lens, qsl, recent, checks, sinks)


@torch.no_grad()
def recent_decode_attention(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, params: AttentionParams, *, recent: int,
                            checks: bool = True,
                            tail_block_tables: Optional[torch.Tensor] = None, sinks: int = 0,
                            reference: bool = False) -> torch.Tensor:
    """`decode_attention` (q [B, Hq, D], one query per sequence at seq_lens[b] - 1; length-0
    rows give zeros) with the last `recent` keys read from `tail` (through `tail_block_tables`
    when given, see `recent_prefill_attention`)."""
    tail_tables = None if reference else prepare_split_decode(
        q, layer, tail, block_tables, seq_lens, params, recent=recent, checks=checks,
        tail_block_tables=tail_block_tables, sinks=sinks)
    if tail_tables is not None:
        return split_rows(q, layer, tail, block_tables, seq_lens, tail_tables, params, recent, sinks)
    counts = (seq_lens > 0).to(torch.int32)
    qsl = torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    qsl[1:] = torch.cumsum(counts, 0)
    keep = counts.bool()
    out = torch.zeros_like(q)
    if bool(keep.any()):
        out[keep] = recent_prefill_attention(q[keep].contiguous(), layer, tail, block_tables, seq_lens, qsl,
                                             params, recent=recent, checks=checks,
                                             tail_block_tables=tail_block_tables, sinks=sinks,
                                             reference=reference)
    return out
