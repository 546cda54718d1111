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
implementation (readable torch, one sequence in fp32 at a time); no fast path exists yet, so
every backend runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codecs import wht
from ..codecs.catalogue import Codec, get_codec
from ..errors import ConfigError
from . import transform
from .batch import AttentionParams, PagedLayer
from .reference.attention import attention_logits, gather_rows, masked_softmax, varlen_query_chunks
from .validate import check_prefill


@dataclass(frozen=True)
class RecentWindow:
    """The high-precision recent window: `tokens` (R >= 1) last positions of each sequence are
    read from a tail stored with `codec` (a catalogue row or its name; default bf16)."""

    tokens: int
    codec: Codec = get_codec("bf16")

    def __post_init__(self):
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ConfigError(f"recent window tokens must be an integer >= 1, got {self.tokens!r}")
        object.__setattr__(self, "codec", get_codec(self.codec))
        if self.codec.traits.tensor_scaled:
            raise ConfigError(f"recent window codec {self.codec.name!r} needs a tensor scale; use a "
                              "self-scaled codec such as bf16, f16, q8_0 or turbo8")

    @property
    def name(self) -> str:
        """`r64` (bf16 tail) or `r64q8_0`: the suffix `+r...` of an eval format label."""
        return f"r{self.tokens}" + ("" if self.codec.name == "bf16" else self.codec.name)


def stored_tail_tokens(seq_len: int, recent: int, block_size: int) -> int:
    """Token slots of the tail blocks a paged recent window holds for a sequence of `seq_len`
    tokens: the blocks covering positions max(0, seq_len - R) .. seq_len - 1."""
    if seq_len <= 0:
        return 0
    first = max(0, seq_len - recent) // block_size
    return ((seq_len - 1) // block_size - first + 1) * block_size


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
                  tail: PagedLayer, params: AttentionParams, recent: int) -> torch.Tensor:
    """fp32 attention of one sequence: q float [Tq, Hq, D]; kv = (k, v) float32 [n, H, D] decoded
    from `layer`, tail_kv from `tail` (rows outside every query's window may be anything
    finite); q_pos int64 [Tq]. Returns float32 [Tq, Hq, D]."""
    tq, hq, _ = q.shape
    h = layer.num_kv_heads
    n = kv[0].shape[0]
    key_pos = torch.arange(n, device=q.device)
    in_tail = key_pos[None, :] > q_pos[:, None] - recent  # [Tq, n]
    s = torch.where(in_tail, attention_logits(q, tail_kv[0], tail), attention_logits(q, kv[0], layer))
    p = masked_softmax(s, q_pos, params, sink_shape=(h, hq // h, 1, 1))
    parts = (p * ~in_tail, p * in_tail)
    sums = [x.sum(-1).permute(2, 0, 1).reshape(tq, hq) for x in parts]
    if params.sparse_v_threshold > 0:
        parts = tuple(torch.where(p < params.sparse_v_threshold, torch.zeros_like(x), x) for x in parts)
    return (_values(parts[0], kv[1], layer, sums[0]) + _values(parts[1], tail_kv[1], tail, sums[1]))


def _rows(layer: PagedLayer, table: torch.Tensor, n: int, start: int):
    """(k, v) float32 [n, H, D] of one sequence with rows before `start` zeroed (not decoded)."""
    bs = layer.block_size
    first = start // bs
    out = []
    for codec, pool, scale in ((layer.k_codec, layer.k_pool, layer.k_scale),
                               (layer.v_codec, layer.v_pool, layer.v_scale)):
        x = gather_rows(layer, codec, pool, scale, table[first:], n - first * bs)
        full = torch.zeros(n, *x.shape[1:], dtype=x.dtype, device=x.device)
        full[first * bs:] = x
        out.append(full)
    return tuple(out)


def _check_tail(layer: PagedLayer, tail: PagedLayer, recent: int) -> None:
    if not isinstance(tail, PagedLayer):
        raise ConfigError(f"tail must be a PagedLayer, got {type(tail).__name__}")
    same = (tail.block_size, tail.num_kv_heads, tail.head_dim) == (layer.block_size, layer.num_kv_heads, layer.head_dim)
    if not same or tail.num_blocks < layer.num_blocks:
        raise ConfigError("the tail layer must have the layer's block size, heads, head_dim and blocks")
    if isinstance(recent, bool) or not isinstance(recent, int) or recent < 1:
        raise ConfigError(f"recent must be an integer >= 1, got {recent!r}")


@torch.no_grad()
def recent_prefill_attention(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, query_start_loc: torch.Tensor, params: AttentionParams,
                             *, recent: int, checks: bool = True) -> torch.Tensor:
    """`prefill_attention` (same tensors and positions) with the last `recent` keys of each
    query read from `tail` (same block tables and slots). Returns [Tq, Hq, D] in q's dtype."""
    _check_tail(layer, tail, recent)
    check_prefill(q, layer, block_tables, seq_lens, query_start_loc, params, checks)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n, chunks in varlen_query_chunks(seq_lens, query_start_loc, q.shape[1], q.device):
        table = block_tables[b]
        lo_q = int(chunks[0][2][0]) if n else 0
        kv = _rows(layer, table, n, 0)
        tail_kv = _rows(tail, table, n, max(0, lo_q - recent + 1))
        for a, e, q_pos in chunks:
            out[a:e] = attend_recent(q[a:e], kv, tail_kv, q_pos, layer, tail, params, recent)
    return out.to(q.dtype)


@torch.no_grad()
def recent_decode_attention(q: torch.Tensor, layer: PagedLayer, tail: PagedLayer, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, params: AttentionParams, *, recent: int,
                            checks: bool = True) -> torch.Tensor:
    """`decode_attention` (q [B, Hq, D], one query per sequence at seq_lens[b] - 1; length-0
    rows give zeros) with the last `recent` keys read from `tail`."""
    counts = (seq_lens > 0).to(torch.int32)
    qsl = torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    qsl[1:] = torch.cumsum(counts, 0)
    keep = counts.bool()
    out = torch.zeros_like(q)
    if bool(keep.any()):
        out[keep] = recent_prefill_attention(q[keep].contiguous(), layer, tail, block_tables, seq_lens, qsl,
                                             params, recent=recent, checks=checks)
    return out
