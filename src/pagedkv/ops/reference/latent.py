"""Reference (oracle) store and attention for latent (MLA) layers, readable torch.

Absorbed multi-head latent attention over a cached latent `c_j` [L] and rotary key `r_j` [R] per
token (shared by all heads). With the per-head projections absorbed into the query and the
output (done by the caller, see `pagedkv.integrations.deepseek`):
- logits `s_hj = scale * (q_lat_h . c_j + q_rope_h . r_j)`, soft-cap `cap * tanh(s / cap)`;
- visibility, sinks, sparse V exactly as `pagedkv.ops.reference.attention` (docs/internals.md);
- output `o_h = sum_j p_hj c_j` [L] (the caller projects it back with W_UV).
Rows are decoded in the ORIGINAL basis (the inverse WHT is applied per section), so this oracle
shares no rotated-basis arithmetic with the fast paths. One sequence is materialised in fp32 at a
time: fine for an oracle, not for speed.
"""

from __future__ import annotations

import torch

from ...codecs import reference as codec_ref
from ...codecs.layout import block_views
from ..batch import AttentionParams, PagedLayer
from ..latent_layer import LatentLayer
from .attention import masked_softmax, varlen_query_chunks
from .store import store as _store
from .store import tensor_scale


def store(layer: LatentLayer, latent: torch.Tensor, rope: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Encode latent float [T, L] and rope float [T, R] into their slots (int64 [T], <0 skips)."""
    secs = layer.sections()
    if layer.spec.uniform:
        _store(secs[0], torch.cat([latent.float(), rope.float()], -1)[:, None], None, slot_mapping)
    else:
        _store(secs[0], latent.float()[:, None], None, slot_mapping)
        _store(secs[1], rope.float()[:, None], None, slot_mapping)


def _section_rows(sec: PagedLayer, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """First n tokens of one section -> float32 [n, dims], original basis."""
    bs, d = sec.block_size, sec.head_dim
    data, scales = block_views(sec.k_codec, sec.k_pool, bs, 1, d)
    ids = block_table[: -(-n // bs)].long()
    slots = ids.numel() * bs
    rows = data[ids].reshape(slots, data.shape[-1])[:n]
    row_scales = scales[ids].reshape(slots, scales.shape[-1])[:n]
    return codec_ref.decode(sec.k_codec, rows, row_scales, d, tensor_scale(sec.k_codec, sec.k_scale))


def sequence_rows(layer: LatentLayer, block_table: torch.Tensor, n: int):
    """(c float32 [n, L], r float32 [n, R]) of one sequence, original basis."""
    secs = layer.sections()
    if layer.spec.uniform:
        rows = _section_rows(secs[0], block_table, n)
        return rows[:, : layer.latent_dim], rows[:, layer.latent_dim:]
    return _section_rows(secs[0], block_table, n), _section_rows(secs[1], block_table, n)


def attend(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, r: torch.Tensor,
           q_pos: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """fp32 absorbed attention of one sequence.

    q_lat float [Tq, Hq, L], q_rope float [Tq, Hq, R]; c float32 [n, L], r float32 [n, R];
    q_pos int64 [Tq]. Returns float32 [Tq, Hq, L].
    """
    s = (torch.einsum("thl,nl->htn", q_lat.float(), c) + torch.einsum("thr,nr->htn", q_rope.float(), r))
    p = masked_softmax(s, q_pos, params, sink_shape=(-1, 1, 1))  # [Hq, Tq, n]
    if params.sparse_v_threshold > 0:
        p = torch.where(p < params.sparse_v_threshold, torch.zeros_like(p), p)
    return torch.einsum("htn,nl->thl", p, c)


def decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: LatentLayer,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     params: AttentionParams) -> torch.Tensor:
    """q_lat [B, Hq, L], q_rope [B, Hq, R] (query at position seq_lens[b] - 1) -> [B, Hq, L] in
    q_lat's dtype; a row with seq_lens[b] == 0 gives zeros."""
    b_, hq, L = q_lat.shape
    out = torch.zeros(b_, hq, L, dtype=torch.float32, device=q_lat.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        c, r = sequence_rows(layer, block_tables[b], n)
        pos = torch.tensor([n - 1], device=q_lat.device)
        out[b] = attend(q_lat[b:b + 1], q_rope[b:b + 1], c, r, pos, params)[0]
    return out.to(q_lat.dtype)


def prefill_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: LatentLayer,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """Packed varlen queries q_lat [Tq, Hq, L], q_rope [Tq, Hq, R], bottom-right causal (query j
    of sequence b at seq_lens[b] - q_len_b + j) -> [Tq, Hq, L] in q_lat's dtype."""
    out = torch.zeros(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for b, n, chunks in varlen_query_chunks(seq_lens, query_start_loc, q_lat.shape[1], q_lat.device):
        c, r = sequence_rows(layer, block_tables[b], n)
        for a, e, pos in chunks:
            out[a:e] = attend(q_lat[a:e], q_rope[a:e], c, r, pos, params)
    return out.to(q_lat.dtype)
