"""Public ops for latent (MLA) layers: store and absorbed decode / chunked-prefill attention.

Semantics: `pagedkv.ops.reference.latent` (logits `scale * (q_lat . c + q_rope . r)`, soft-cap,
causal / sliding window, sinks, output `sum_j p_j c_j` [L]). The caller absorbs the per-head
projections: `q_lat_h = W_UK_h^T q_nope_h` before, `o_h = W_UV_h o_lat_h` after.

Backends (`backend=`):
- None (automatic): a uniform layout (`LatentSpec.uniform`) is one `PagedLayer` with one KV head
  whose values are its keys, so the generic ops serve it as MQA: q = [q_lat | q_rope] over the
  row [c | r], output[:L] (the extra rope columns of the output cost R/(L+R) of the V work). On
  CPU this is the fused C kernel, on CUDA the Triton kernels when they take head_dim L+R (today
  <= 256, so not 512 + 64); when only the reference would serve it, and for a mixed layout (rope
  in another codec), `"chunked"` runs.
- "chunked": torch, walks each sequence's blocks in chunks of `CHUNK_TOKENS` with an online
  softmax (fp32), decoding only the chunk (never the whole context in high precision); queries
  are tiled so logits stay under `LOGIT_BUDGET`; chunks wholly outside every query's sliding
  window are skipped. Sparse V is not applied (exact; allowed: a fast path may drop a subset).
- "reference": the oracle; any registered ops backend name ("cpu", "triton", ...) for a
  uniform layout.
All validation happens before any write / compute and raises InvalidInput naming the argument.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..codecs import reference as codec_ref
from ..codecs import wht
from ..codecs.catalogue import Codec, ScaleType, ValueKind
from ..codecs.layout import block_views
from ..errors import InvalidInput
from . import api, validate
from .batch import AttentionParams, PagedLayer
from .dispatch import Backend, Op, select_backend
from .latent_layer import LatentLayer, LatentSpec, make_latent_layer
from .reference import latent as ref
from .reference.store import tensor_scale

CHUNK_TOKENS = 512
LOGIT_BUDGET = 1 << 22  # fp32 logits per (query tile x key chunk)

LatentBackend = Union[None, str, Backend]

__all__ = ["LatentSpec", "LatentLayer", "make_latent_layer", "latent_store",
           "latent_decode_attention", "latent_prefill_attention"]


# ---- validation ---------------------------------------------------------------------------------
def _check_layer(layer) -> tuple[PagedLayer, ...]:
    if not isinstance(layer, LatentLayer):
        raise InvalidInput(f"layer must be a LatentLayer, got {type(layer).__name__}")
    want = layer.spec.block_bytes(layer.block_size)
    if layer.pool.dtype != torch.uint8 or layer.pool.dim() != 2 or layer.pool.shape[1] != want:
        raise InvalidInput(f"layer.pool must be uint8 [num_blocks, {want}] for {layer.spec.name} "
                           f"(block_size {layer.block_size}), got {layer.pool.dtype} "
                           f"{tuple(layer.pool.shape)}")
    secs = layer.sections()
    for s in secs:
        validate.check_layer(s)
    return secs


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str], layer: LatentLayer) -> None:
    for x, name, d in ((a, names[0], layer.latent_dim), (b, names[1], layer.rope_dim)):
        validate.check_tensor(name, x, dtypes=validate.FLOAT_DTYPES, dim=a.dim(), device=layer.device)
        if x.shape[-1] != d:
            raise InvalidInput(f"{name} must have {d} dims last (the layer's "
                               f"{'latent' if name == names[0] else 'rope'} dim), got {list(x.shape)}")
    if a.shape[:-1] != b.shape[:-1]:
        raise InvalidInput(f"{names[0]} {list(a.shape)} and {names[1]} {list(b.shape)} must agree in "
                           "every dim but the last")


def _check_backend(layer: LatentLayer, backend) -> None:
    if not layer.spec.uniform and backend not in (None, "chunked", "reference"):
        name = getattr(backend, "name", backend)
        raise InvalidInput(
            f"backend {name!r} reads one-codec rows; layout {layer.spec.name} keeps the rope part in "
            "another codec: use backend=None, 'chunked' or 'reference'"
        )


def _fused(op: Op, sec: PagedLayer, params: AttentionParams, backend: LatentBackend):
    """The ops backend that serves a one-codec row as MQA, or None for the chunked path: a named
    backend is used as named; automatic picks the device's best backend unless that is only the
    reference (e.g. Triton declines head_dim > 256), which the chunked path beats on memory."""
    if backend == "chunked":
        return None
    if backend is not None:
        return backend
    impl = select_backend(op, sec.device, sec, params, None)
    return None if impl.name == "reference" else impl


def _query_view(secs, q_lat, q_rope, uniform: bool):
    """What the section checks see: [q_lat | q_rope] (uniform) or q_lat / q_rope per section."""
    if uniform:
        return (torch.cat([q_lat, q_rope], -1),)
    return (q_lat, q_rope)


# ---- store ----------------------------------------------------------------------------------------
def check_latent_store(layer: LatentLayer, latent: torch.Tensor, rope: torch.Tensor,
                       slot_mapping: torch.Tensor, checks: bool = True) -> tuple:
    """Every check `latent_store` makes (InvalidInput naming the argument), writing nothing:
    for a caller that must know the input is good before it changes anything else (a first
    store fixes fp8 scales from the rows). Returns (sections, their rows [T, 1, dims])."""
    secs = _check_layer(layer)
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2:
        raise InvalidInput(f"latent must be a float [T, {layer.latent_dim}] tensor, got "
                           f"{list(getattr(latent, 'shape', [])) or type(latent).__name__}")
    _check_pair(latent, rope, ("latent", "rope"), layer)
    rows = ((torch.cat([latent, rope], -1),) if layer.spec.uniform else (latent, rope))
    rows = tuple(r[:, None, :] for r in rows)
    for s, r in zip(secs, rows):
        validate.check_store(s, r, None, slot_mapping, checks)
    return secs, rows


@torch.no_grad()
def latent_store(layer: LatentLayer, latent: torch.Tensor, rope: torch.Tensor,
                 slot_mapping: torch.Tensor, *, backend: LatentBackend = None,
                 checks: bool = True) -> None:
    """Encode new tokens' latent float [T, L] and rope float [T, R] (after RoPE) into their
    slots (int64 [T], slot = block_id * block_size + offset, negative = skip). Raises
    InvalidInput before any write (`check_latent_store`)."""
    secs, rows = check_latent_store(layer, latent, rope, slot_mapping, checks)
    be = None if backend == "chunked" else backend
    for s, r in zip(secs, rows):
        api.store(s, r, None, slot_mapping, backend=be, checks=False)


# ---- attention -------------------------------------------------------------------------------------
@torch.no_grad()
def latent_decode_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: LatentLayer,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            params: AttentionParams, *, backend: LatentBackend = None,
                            checks: bool = True) -> torch.Tensor:
    """One query per sequence: q_lat float [B, Hq, L], q_rope float [B, Hq, R] (absorbed, RoPE
    applied), block_tables int32 [B, max_blocks], seq_lens int32 [B] (query at seq_lens[b] - 1,
    0 = padding row -> zeros). Returns [B, Hq, L] in q_lat's dtype."""
    secs = _check_layer(layer)
    _check_pair(q_lat, q_rope, ("q_lat", "q_rope"), layer)
    _check_backend(layer, backend)
    qs = _query_view(secs, q_lat, q_rope, layer.spec.uniform)
    for s, q in zip(secs, qs):
        validate.check_decode(q, s, block_tables, seq_lens, params, checks)
    if backend == "reference":
        return ref.decode_attention(q_lat, q_rope, layer, block_tables, seq_lens, params)
    fused = _fused(Op.DECODE, secs[0], params, backend) if layer.spec.uniform else None
    if fused is not None:
        out = api.decode_attention(qs[0], secs[0], block_tables, seq_lens, params, backend=fused,
                                   checks=False)
        return out[..., : layer.latent_dim].to(q_lat.dtype).contiguous()
    qsl = torch.arange(q_lat.shape[0] + 1, dtype=torch.int32, device=q_lat.device)
    return _chunked(q_lat, q_rope, layer, block_tables, seq_lens, qsl, params)


@torch.no_grad()
def latent_prefill_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, layer: LatentLayer,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             query_start_loc: torch.Tensor, params: AttentionParams, *,
                             backend: LatentBackend = None, checks: bool = True) -> torch.Tensor:
    """Packed varlen queries q_lat [Tq, Hq, L], q_rope [Tq, Hq, R]; query_start_loc int32 [B+1];
    seq_lens int32 [B] include the new tokens (stored before the call); query j of sequence b is
    at seq_lens[b] - q_len_b + j (bottom-right causal). Returns [Tq, Hq, L] in q_lat's dtype."""
    secs = _check_layer(layer)
    _check_pair(q_lat, q_rope, ("q_lat", "q_rope"), layer)
    _check_backend(layer, backend)
    qs = _query_view(secs, q_lat, q_rope, layer.spec.uniform)
    for s, q in zip(secs, qs):
        validate.check_prefill(q, s, block_tables, seq_lens, query_start_loc, params, checks)
    if backend == "reference":
        return ref.prefill_attention(q_lat, q_rope, layer, block_tables, seq_lens, query_start_loc,
                                     params)
    fused = _fused(Op.PREFILL, secs[0], params, backend) if layer.spec.uniform else None
    if fused is not None:
        out = api.prefill_attention(qs[0], secs[0], block_tables, seq_lens, query_start_loc, params,
                                    backend=fused, checks=False)
        return out[..., : layer.latent_dim].to(q_lat.dtype).contiguous()
    return _chunked(q_lat, q_rope, layer, block_tables, seq_lens, query_start_loc, params)


# ---- the chunked torch path -------------------------------------------------------------------------
def _decode_chunk(sec: PagedLayer, ids: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Tokens [start, start+count) of the blocks `ids` (the chunk's block ids, the first holding
    token start - start % block_size) -> float32 [count, dims] in the stored (rotated) basis."""
    data, scales = block_views(sec.k_codec, sec.k_pool, sec.block_size, 1, sec.head_dim)
    off = start % sec.block_size
    slots = ids.numel() * sec.block_size
    rows = data[ids].reshape(slots, data.shape[-1])[off:off + count]
    rs = scales[ids].reshape(slots, scales.shape[-1])[off:off + count]
    return decode_rows(sec.k_codec, rows, rs, sec.head_dim, tensor_scale(sec.k_codec, sec.k_scale))


def decode_rows(codec: Codec, rows: torch.Tensor, scales: torch.Tensor, dims: int,
                tscale: Optional[float]) -> torch.Tensor:
    """`codecs.reference.decode(..., rotated_basis=True)` with faster torch for fp8 and q8_0.

    fp8: an E4M3 byte `s eeee mmm` placed as fp16 bits `s 0eeee mmm0000000` is its value / 256
    (subnormals included), so one int16 shift replaces the 256-entry table gather; the two NaN
    codes (never written: the encoder saturates at 448) decode to 0 as in the table. q8_0: int8
    codes times fp16 group scales. Identical values to the reference (tests check every code).
    rows uint8 [n, row_data_bytes], scales uint8 [n, row_scale_bytes] -> float32 [n, dims]."""
    if codec.values is ValueKind.FP8_E4M3 and codec.scale_type is ScaleType.TENSOR_FP32:
        b = rows.to(torch.int16)
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        h = torch.where((b & 0x7F) == 0x7F, torch.zeros_like(h), h)
        return h.view(torch.float16).float() * (256.0 * (1.0 if tscale is None else tscale))
    if codec.values is ValueKind.INT and codec.code_bits == 8 and codec.scale_type is ScaleType.FP16:
        n, g = rows.shape[0], codec.group_size
        s = scales.contiguous().view(torch.float16).float().view(n, dims // g, 1)
        return (rows.view(torch.int8).float().view(n, dims // g, g) * s).view(n, dims)
    return codec_ref.decode(codec, rows, scales, dims, tscale, rotated_basis=True)


def _chunked(q_lat, q_rope, layer: LatentLayer, block_tables, seq_lens, query_start_loc,
             params: AttentionParams) -> torch.Tensor:
    """Online-softmax attention walking each sequence's blocks in chunks (see module doc)."""
    secs = layer.sections()
    L = layer.latent_dim
    tq_all, hq, _ = q_lat.shape
    dev = q_lat.device
    # q per section, in each section's stored basis (rotated once when the codec rotates)
    if layer.spec.uniform:
        parts = [torch.cat([q_lat.float(), q_rope.float()], -1)]
    else:
        parts = [q_lat.float(), q_rope.float()]
    parts = [wht.rotate(p) if s.k_codec.rotated else p for p, s in zip(parts, secs)]
    d0 = secs[0].head_dim
    out = torch.zeros(tq_all, hq, L, dtype=torch.float32, device=dev)
    bs = layer.block_size
    chunk = max(bs, (CHUNK_TOKENS // bs) * bs)
    sinks = None if params.sinks is None else params.sinks.to(dev, torch.float32).reshape(hq, 1)
    starts = query_start_loc.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo or n == 0:
            continue
        table = block_tables[b].long()
        tile = max(1, LOGIT_BUDGET // (hq * chunk))
        for a in range(lo, hi, tile):
            e = min(hi, a + tile)
            pos = torch.arange(n - (hi - lo) + (a - lo), n - (hi - lo) + (e - lo), device=dev)
            first = 0
            if params.sliding_window is not None:
                first = max(0, int(pos[0]) - params.sliding_window + 1)
            last = int(pos[-1]) + 1
            t = e - a
            qp = [p[a:e].transpose(0, 1).reshape(hq * t, -1) for p in parts]  # [Hq * t, d]
            m = torch.full((hq, t), float("-inf"), device=dev)
            z = torch.zeros(hq, t, device=dev)
            acc = torch.zeros(hq, t, d0, device=dev)
            c0 = (first // bs) * bs
            for k0 in range(c0, last, chunk):
                k1 = min(last, k0 + chunk)
                ids = table[k0 // bs: -(-k1 // bs)]
                rows = [_decode_chunk(s, ids, k0, k1 - k0) for s in secs]
                s_ = qp[0] @ rows[0].T
                for q, r in zip(qp[1:], rows[1:]):
                    s_ = s_.addmm_(q, r.T)
                s_ = (s_ * params.scale).view(hq, t, -1)
                if params.soft_cap is not None:
                    s_ = params.soft_cap * torch.tanh(s_ / params.soft_cap)
                kp = torch.arange(k0, k1, device=dev)
                vis = kp[None, :] <= pos[:, None]
                if params.sliding_window is not None:
                    vis &= kp[None, :] > pos[:, None] - params.sliding_window
                s_ = s_.masked_fill(~vis[None], float("-inf"))
                m_new = torch.maximum(m, s_.amax(-1))
                safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
                alpha = torch.exp(m - safe)
                p = torch.exp(s_ - safe[..., None])
                z = z * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + (p.view(hq * t, -1) @ rows[0]).view(hq, t, -1)
                m = m_new
            if sinks is not None:
                m_f = torch.maximum(m, sinks)
                f = torch.exp(m - m_f)
                z = z * f + torch.exp(sinks - m_f)
                acc = acc * f[..., None]
            o = acc / torch.where(z > 0, z, torch.ones_like(z))[..., None]
            if secs[0].k_codec.rotated:
                o = wht.unrotate(o)
            out[a:e] = o[..., :L].transpose(0, 1)
    return out.to(q_lat.dtype)
