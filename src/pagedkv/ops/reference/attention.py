"""Reference attention over the paged, compressed cache: gather, decode, fp32 attention.

The oracle for every fast path. Per sequence it gathers the codes through the block table,
decodes them in the ROTATED basis (`rotated_basis=True`), rotates q once when K is rotated,
computes fp32 attention and un-rotates the output once when V is rotated. It materialises one
sequence's context in fp32 at a time: fine for an oracle, not for speed.

Semantics (the fast paths must match):
- the per-layer transform (`pagedkv.ops.transform`): q' = q / layer.k_mult (or q); stored keys
  are k_j * k_mult - c with c = layer.k_centre (or 0), stored values v_j - layer.v_centre;
- logits s_j = scale * (q' . (k_j m - c) + q' . c) (= scale * q . k_j), then soft-cap
  `cap * tanh(s / cap)`;
- visibility: key j is seen by a query at position p iff j <= p and (no window or j > p - W);
- sinks (one logit per q head, used as given: not scaled, not capped) join the denominator:
  m = max(max_j s_j, sink), Z = sum_j exp(s_j - m) + exp(sink - m), p_j = exp(s_j - m) / Z;
- sparse V: with threshold t > 0, positions with p_j < t contribute nothing; the kept weights
  are NOT renormalised, so out = sum_{p_j >= t} p_j v_j (a fast path skips the V reads of a
  subset of these positions, see docs/internals.md "Sparse V");
- value centre: out += v_centre * sum_j p_j (all token weights, before the sparse-V drop: 1
  without sinks, less with them), so the centre itself is exact even under sparse V;
- a decode sequence of length 0 (batch padding) outputs zeros;
- the output has q's dtype; all arithmetic is fp32.
"""

from __future__ import annotations

import torch

from ...codecs import reference as codec_ref
from ...codecs import wht
from ...codecs.catalogue import Codec
from ...codecs.layout import block_views
from .. import transform
from ..batch import AttentionParams, PagedLayer
from .store import tensor_scale

LOGIT_BUDGET = 1 << 24  # fp32 logits per prefill chunk (64 MiB; a few such temporaries live at once)


def gather_rows(layer: PagedLayer, codec: Codec, pool: torch.Tensor, scale: torch.Tensor,
                block_table: torch.Tensor, n: int) -> torch.Tensor:
    """Decode the first n tokens of one sequence -> float32 [n, num_kv_heads, head_dim].

    Values stay in the codec's stored (rotated, for rotated codecs) basis.
    block_table: int [max_blocks], logical block -> physical block id.
    """
    bs, h, d = layer.block_size, layer.num_kv_heads, layer.head_dim
    data, scales = block_views(codec, pool, bs, h, d)
    ids = block_table[: -(-n // bs)].long()
    slots = ids.numel() * bs
    rows = data[ids].reshape(slots, h, data.shape[-1])[:n]
    row_scales = scales[ids].reshape(slots, h, scales.shape[-1])[:n]
    return codec_ref.decode(codec, rows, row_scales, d, tensor_scale(codec, scale), rotated_basis=True)


def attention_weights(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, layer: PagedLayer,
                      params: AttentionParams) -> torch.Tensor:
    """Exact softmax weights of one sequence: float32 [H, G, Tq, n] (sinks in the denominator).

    q: float [Tq, Hq, D] (original basis, Hq = H * G); k: float32 [n, H, D] in the stored basis;
    q_pos: int64 [Tq] positions of the queries.
    """
    h, hq = layer.num_kv_heads, q.shape[1]
    return masked_softmax(attention_logits(q, k, layer), q_pos, params, sink_shape=(h, hq // h, 1, 1))


def attention_logits(q: torch.Tensor, k: torch.Tensor, layer: PagedLayer) -> torch.Tensor:
    """Raw logits float32 [H, G, Tq, n] (before scale, cap, mask) of q float [Tq, Hq, D]
    (original basis) against keys k float32 [n, H, D] in `layer`'s stored basis: q / k_mult,
    rotated when K is, plus q . k_centre."""
    tq, hq, d = q.shape
    h = layer.num_kv_heads
    qf = transform.query_for_keys(layer, q).reshape(tq, h, hq // h, d)
    qk = wht.rotate(qf) if layer.k_codec.rotated else qf
    s = torch.einsum("thgd,nhd->hgtn", qk, k)
    if layer.k_centre is not None:
        centre = layer.k_centre.to(qf.device, torch.float32)
        s = s + torch.einsum("thgd,hd->hgt", qf, centre)[..., None]
    return s


def masked_softmax(s: torch.Tensor, q_pos: torch.Tensor, params: AttentionParams,
                   sink_shape: tuple) -> torch.Tensor:
    """Raw logits float32 [..., Tq, n] of one sequence -> softmax weights, same shape.

    Applies the scale, the soft-cap, the causal and sliding-window mask (keys at positions
    0..n-1, queries at q_pos int64 [Tq]) and the sinks (reshaped to `sink_shape`, broadcast
    against [..., Tq, 1]) in the denominator. Shared by the K/V and the latent oracle.
    """
    s = s * params.scale
    if params.soft_cap is not None:
        s = params.soft_cap * torch.tanh(s / params.soft_cap)
    key_pos = torch.arange(s.shape[-1], device=s.device)
    visible = key_pos[None, :] <= q_pos[:, None]
    if params.sliding_window is not None:
        visible &= key_pos[None, :] > q_pos[:, None] - params.sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    m = s.amax(-1, keepdim=True)
    if params.sinks is not None:
        sink = params.sinks.to(s.device, torch.float32).reshape(sink_shape)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(-1, keepdim=True)
    if params.sinks is not None:
        z = z + torch.exp(sink - m)
    return e / z


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           layer: PagedLayer, params: AttentionParams) -> torch.Tensor:
    """fp32 attention of one sequence.

    q: float [Tq, Hq, D] (original basis); k, v: float32 [n, H, D] in the stored bases;
    q_pos: int64 [Tq] positions of the queries. Returns float32 [Tq, Hq, D] (original basis).
    """
    tq, hq, d = q.shape
    p = attention_weights(q, k, q_pos, layer, params)
    weight_sum = p.sum(-1).permute(2, 0, 1).reshape(tq, hq) if layer.v_centre is not None else None
    if params.sparse_v_threshold > 0:
        p = torch.where(p < params.sparse_v_threshold, torch.zeros_like(p), p)
    out = torch.einsum("hgtn,nhd->thgd", p, v)
    if layer.v_codec.rotated:
        out = wht.unrotate(out)
    out = out.reshape(tq, hq, d)
    if weight_sum is not None:
        transform.add_value_centre(layer, out, weight_sum)
    return out


def _sequence_kv(layer: PagedLayer, block_table: torch.Tensor, n: int):
    k = gather_rows(layer, layer.k_codec, layer.k_pool, layer.k_scale, block_table, n)
    v = gather_rows(layer, layer.v_codec, layer.v_pool, layer.v_scale, block_table, n)
    return k, v


def decode_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """One query token per sequence.

    q: float [B, Hq, D]; block_tables: int32 [B, max_blocks]; seq_lens: int32 [B] (the query is
    at position seq_lens[b] - 1; its own K/V were stored before the call). Returns [B, Hq, D]
    in q's dtype.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = _sequence_kv(layer, block_tables[b], n)
        q_pos = torch.tensor([n - 1], device=q.device)
        out[b] = attend(q[b : b + 1], k, v, q_pos, layer, params)[0]
    return out.to(q.dtype)


def varlen_query_chunks(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_q_heads: int,
                        device: torch.device):
    """The packed varlen prefill walk of the reference ops.

    Yields (b, n, chunks) for every sequence b with queries, n = seq_lens[b]; chunks lists
    (a, e, positions): q rows a:e and their positions int64 [e - a] (bottom-right causal, the
    last query at n - 1), cut so that the [Hq, rows, n] fp32 logits stay near LOGIT_BUDGET.
    """
    starts = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        pos = torch.arange(n - (hi - lo), n, device=device)
        step = max(1, LOGIT_BUDGET // max(1, num_q_heads * n))
        bounds = [(a, min(hi, a + step)) for a in range(lo, hi, step)]
        yield b, n, [(a, e, pos[a - lo : e - lo]) for a, e in bounds]


def prefill_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      params: AttentionParams) -> torch.Tensor:
    """Several query tokens per sequence, packed varlen, causal and bottom-right aligned.

    q: float [Tq, Hq, D]; query_start_loc: int32 [B+1] (sequence b owns q rows
    query_start_loc[b]:query_start_loc[b+1]); seq_lens: int32 [B] including the new tokens,
    which were stored before the call; query j of sequence b is at position
    seq_lens[b] - q_len_b + j. Returns [Tq, Hq, D] in q's dtype.
    """
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n, chunks in varlen_query_chunks(seq_lens, query_start_loc, q.shape[1], q.device):
        k, v = _sequence_kv(layer, block_tables[b], n)
        for a, e, q_pos in chunks:
            out[a:e] = attend(q[a:e], k, v, q_pos, layer, params)
    return out.to(q.dtype)
