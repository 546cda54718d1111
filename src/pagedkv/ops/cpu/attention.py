"""Python side of the fast CPU attention: describe the codecs, prepare q, call the C kernel.

What happens around the kernel (once per call, O(Tq * Hq * D), never O(context)):
- q float [Tq, Hq, D] -> fp32, divided by `layer.k_mult` (per kv head, `ops.transform`);
  rotated by the WHT when K is stored rotated; multiplied by
  `params.scale` (and the fp8 K tensor scale), so the kernel's score is a plain dot product;
- `layer.k_centre` [H, D] -> a per-query bias `scale * q . k_centre` [Tq, Hq] added to every
  score (keys are stored as k - centre, before the rotation);
- the output [Tq, Hq, D] fp32 is multiplied by the fp8 V tensor scale (inside the kernel) and
  un-rotated when V is stored rotated; `layer.v_centre` is added (times each row's token-weight
  sum: 1, or 0 for an empty decode row; with sinks the kernel does not report the sinks' weight,
  so that one case runs the reference ops instead, `_reference_attention`, logged once per codec
  pair); then cast to q's dtype.

A codec side is described to the kernel by its properties (`side_desc`): code bits, how a code
becomes a value (bf16 raw, E4M3 bits, int8, or a table lookup), group size and scale type, the
row byte sizes and where the scale section starts in a block. One kernel serves every pair.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ...codecs import wht
from ...codecs.catalogue import Codec, ScaleType
from ...codecs.derive import DecodeKind
from ...codecs.floats import e4m3_table
from ...errors import InvalidInput
from .. import transform
from ..batch import AttentionParams, PagedLayer
from ..dispatch import log_fallback_once
from ..support import CodecSupport, pairs

EK_BF16, EK_LUT, EK_E4M3, EK_I8 = 0, 1, 2, 3
SC_NONE, SC_E4M3, SC_BF16, SC_FP16 = 0, 1, 2, 3
_SCALE_KIND = {ScaleType.NONE: SC_NONE, ScaleType.TENSOR_FP32: SC_NONE, ScaleType.FP8_E4M3: SC_E4M3,
               ScaleType.BF16: SC_BF16, ScaleType.FP16: SC_FP16}

_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_f32 = ctypes.c_float


class _Side(ctypes.Structure):
    _fields_ = [("pool", _p), ("block_stride", _i64), ("scale_offset", _i64), ("bits", _i32),
                ("kind", _i32), ("group", _i32), ("scale_kind", _i32), ("row_data_bytes", _i32),
                ("row_scale_bytes", _i32), ("table", _p), ("e4m3", _p)]


class _Args(ctypes.Structure):
    _fields_ = [("num_seqs", _i32), ("num_q_heads", _i32), ("num_kv_heads", _i32), ("head_dim", _i32),
                ("block_size", _i32), ("bt_stride", _i32), ("q", _p), ("bias", _p),
                ("block_tables", _p), ("seq_lens", _p), ("query_start", _p), ("window", _i32),
                ("soft_cap", _f32), ("sinks", _p), ("sparse_thr", _f32), ("out_scale", _f32),
                ("out", _p), ("num_threads", _i32), ("rows_per_tile", _i32), ("heads_per_task", _i32),
                ("num_splits", _i32), ("stats", _p), ("int8_scores", _i32), ("lse", _p),
                ("key_start", _i32), ("bf16_dots", _i32)]


@dataclass(frozen=True)
class SideDesc:
    """How the kernel reads one codec: element kind, bits, group, scale kind, 256-entry table."""

    kind: int
    bits: int
    group: int
    scale_kind: int
    table: torch.Tensor  # float32 [256]


# What the C kernel reads (PKV_DISPATCH in attention_kernel.c: bf16, E4M3 and int8 by arithmetic,
# 2/3/4/5/8-bit table codes and 2/3/4-bit offset ints through the value table; scales per
# 16-element chunk, so groups of 16k).
# Declared to the dispatcher with the store's (`write.STORE_SUPPORT`) by the backend
# (`__init__.SUPPORT`), so the dispatcher never hands the kernel another row.
ATTENTION_SUPPORT = CodecSupport(
    decode=(pairs(DecodeKind.RAW_BF16, (16,)) | pairs(DecodeKind.E4M3, (8,)) | pairs(DecodeKind.INT8, (8,))
            | pairs(DecodeKind.INT_OFFSET, (2, 3, 4)) | pairs(DecodeKind.TABLE, (2, 3, 4, 5, 8))),
    groups=frozenset({0, 16, 32, 64}),
)
_KIND = {DecodeKind.RAW_BF16: EK_BF16, DecodeKind.E4M3: EK_E4M3, DecodeKind.INT8: EK_I8,
         DecodeKind.INT_OFFSET: EK_LUT, DecodeKind.TABLE: EK_LUT}


@functools.lru_cache(maxsize=None)
def side_desc(codec: Codec) -> SideDesc:
    """The kernel's description of `codec` (derived from the catalogue row's traits, cached);
    InvalidInput for a row the kernel does not read (the dispatcher declines those first)."""
    why = ATTENTION_SUPPORT.refusal(codec, store=False)
    if why is not None:
        raise InvalidInput(f"the CPU attention kernel does not implement codec {codec.name!r}: {why}")
    t = codec.traits
    table = torch.zeros(256, dtype=torch.float32)
    vt = codec.value_table()
    if vt is not None:
        vt = vt.float().reshape(-1)
        # sub-byte tables are replicated so that ignoring the code's upper bits is harmless
        table = vt.repeat(256 // vt.numel())[:256].contiguous()
    return SideDesc(_KIND[t.decode], t.bits, t.group if t.per_group_scale else 0, _SCALE_KIND[t.scale], table)


_E4M3 = None


def _e4m3() -> torch.Tensor:
    global _E4M3
    if _E4M3 is None:
        _E4M3 = e4m3_table().float().contiguous()
    return _E4M3


_SIDE_STATIC: dict = {}  # (id(codec), H, D, block size) -> (codec, fields of _Side after the pool's)


def _side(codec: Codec, pool: torch.Tensor, layer: PagedLayer) -> _Side:
    """The kernel's description of one side of `layer`. Its codec-derived fields are computed once
    per (codec, geometry) and kept (a call is then a struct fill: the per-call overhead adds up at
    30 layers x every decode step, and it is serial when the kernel runs on several threads)."""
    h, hd, bs = layer.num_kv_heads, layer.head_dim, layer.block_size
    key = (id(codec), h, hd, bs)
    hit = _SIDE_STATIC.get(key)
    if hit is None or hit[0] is not codec:  # the codec is kept, so its id is never reused meanwhile
        d = side_desc(codec)
        hit = (codec, (codec.data_bytes(bs * h * hd), d.bits, d.kind, d.group, d.scale_kind,
                       codec.row_data_bytes(hd), codec.row_scale_bytes(hd), d.table.data_ptr(), _e4m3().data_ptr()))
        _SIDE_STATIC[key] = hit
    return _Side(pool.data_ptr(), pool.stride(0), *hit[1])


def _tensor_scale(codec: Codec, scale: torch.Tensor) -> float:
    return float(scale.reshape(-1)[0]) if codec.scale_type is ScaleType.TENSOR_FP32 else 1.0


def _i32c(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.int32 and x.is_contiguous():  # the usual case: skip two dispatcher calls
        return x
    return x.to(torch.int32).contiguous()


def run_attention(kernel, q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, params: AttentionParams,
                  *, num_threads: Optional[int] = None, stats: Optional[dict] = None,
                  lse: Optional[torch.Tensor] = None, key_start: int = 0,
                  prefill_tile: bool = True) -> torch.Tensor:
    """Attention of packed queries q float [Tq, Hq, D] over the layer (decode: one per sequence).

    block_tables int32 [B, max_blocks]; seq_lens int32 [B]; query_start_loc int32 [B+1]
    (decode: arange(B+1)). Returns [Tq, Hq, D] in q's dtype. num_threads: None =
    torch.get_num_threads(). stats: if a dict, receives "v_rows_read" and "v_rows_skipped".
    lse: None, or float32 [Tq, Hq] (contiguous, CPU) that receives each row's log-sum-exp,
    log(sum_j e^{s_j} + e^{sink}) over the logits s_j of its softmax (-inf: no key, no sink), so
    that calls over disjoint keys merge exactly (ops/recent_decode.py). key_start: keys j <
    key_start are not read (every sequence; with a sliding window, the later of the two bounds).
    prefill_tile: False runs prefill on the general kernel even where the prefill tile covers it
    (`_prefill_tile`; for A/B measurements and tests).
    """
    if layer.k_pool.stride(1) != 1 or layer.v_pool.stride(1) != 1:
        raise InvalidInput("the CPU kernel needs pools with contiguous rows (stride 1 along bytes)")
    if lse is not None and (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32
                            or tuple(lse.shape) != tuple(q.shape[:2]) or not lse.is_contiguous()
                            or lse.device.type != "cpu"):
        raise InvalidInput(f"lse must be a contiguous float32 CPU tensor [Tq, Hq] = {list(q.shape[:2])}, got "
                           f"{getattr(lse, 'dtype', type(lse).__name__)} {list(getattr(lse, 'shape', []))}")
    if isinstance(key_start, bool) or not isinstance(key_start, int) or key_start < 0:
        raise InvalidInput(f"key_start must be an integer >= 0, got {key_start!r}")
    if layer.v_centre is not None and params.sinks is not None:
        if lse is not None or key_start:
            raise InvalidInput(f"lse= and key_start= are not available with sink logits and a value centre "
                               f"(that case runs the reference ops), got lse={'a tensor' if lse is not None else None}, "
                               f"key_start={key_start}")
        log_fallback_once(f"the CPU attention of k={layer.k_codec.name}, v={layer.v_codec.name}",
                          "a value centre with sink logits (the kernel does not return the sinks' weight)",
                          "reference ops")
        return _reference_attention(q, layer, block_tables, seq_lens, query_start_loc, params)
    tq, hq, hd = q.shape
    h = layer.num_kv_heads
    g = hq // h
    qf = transform.query_for_keys(layer, q)
    q_scale = params.scale * _tensor_scale(layer.k_codec, layer.k_scale)
    # one query-sized buffer either way (rotation and scale in one matmul)
    qk = torch.matmul(qf, _scaled_rotation_t(hd, q_scale)) if layer.k_codec.rotated else (qf * q_scale).contiguous()
    k_centre, v_centre = _centres(layer, hq, params.scale)
    bias = None
    if k_centre is not None:  # one fused dot per (token, head): einsum costs ~10x at decode sizes
        bias = torch.linalg.vecdot(qf, k_centre)
    sinks = None if params.sinks is None else params.sinks.float().contiguous()
    bt = _i32c(block_tables)
    lens = _i32c(seq_lens)
    qsl = _i32c(query_start_loc)
    out = torch.empty(tq, hq, hd, dtype=torch.float32)
    counters = torch.zeros(2, dtype=torch.int64) if stats is not None else None
    ks = _side(layer.k_codec, layer.k_pool, layer)
    vs = _side(layer.v_codec, layer.v_pool, layer)

    a = _Args()
    a.num_seqs = int(lens.shape[0])
    a.num_q_heads, a.num_kv_heads, a.head_dim, a.block_size = hq, h, hd, layer.block_size
    a.bt_stride = int(bt.shape[1]) if bt.dim() == 2 else 0
    a.q = qk.data_ptr()
    a.bias = bias.data_ptr() if bias is not None else None
    a.block_tables, a.seq_lens, a.query_start = bt.data_ptr(), lens.data_ptr(), qsl.data_ptr()
    a.window = int(params.sliding_window or 0)
    a.soft_cap = float(params.soft_cap or 0.0)
    a.sinks = sinks.data_ptr() if sinks is not None else None
    a.sparse_thr = float(params.sparse_v_threshold)
    a.out_scale = _tensor_scale(layer.v_codec, layer.v_scale)
    a.out = out.data_ptr()
    a.num_threads = int(num_threads or torch.get_num_threads())
    starts = qsl.tolist()  # a few ints: cheaper than tensor ops (their dispatch dominates here)
    max_q = max((e - b for b, e in zip(starts, starts[1:])), default=0)
    if max_q <= 1:  # decode: every kv head of a block in one task (each cache line read once)
        a.rows_per_tile, a.heads_per_task = 1, h
    else:  # prefill: one kv head per task, ~64 query vectors share each decoded block
        a.rows_per_tile, a.heads_per_task = _prefill_rows(g), 1
    a.num_splits = 0
    a.stats = counters.data_ptr() if counters is not None else None
    a.int8_scores = int(bool(params.int8_scores))
    if lse is None and key_start and layer.v_centre is not None:
        lse = torch.empty(tq, hq, dtype=torch.float32)  # which rows see a key (the value centre's weight)
    a.lse = lse.data_ptr() if lse is not None else None
    a.key_start = int(key_start)
    a.bf16_dots = int(bool(params.bf16_dots))  # decode scores (AVX-512 BF16, bf16-exact K; see the C source)
    entry = kernel.lib.pkv_attention
    if max_q > 1 and _prefill_tile(kernel, params, prefill_tile):
        entry, a.rows_per_tile = _prefill_entry(kernel, params.bf16_dots), _prefill_task_rows(g)
        a.int8_scores = 0  # the tile's scores are exact (int8_scores is a decode path)
    rc = entry(ctypes.byref(a), ctypes.byref(ks), ctypes.byref(vs))
    if rc == -1:
        raise MemoryError("pagedkv CPU attention kernel: out of memory for its working set")
    if rc in (-3, -4):
        c = layer.k_codec if rc == -3 else layer.v_codec
        raise InvalidInput(f"the CPU attention kernel does not implement codec {c.name!r} ({c.code_bits}-bit "
                           f"{c.values.name} codes, group {c.group_size}, {c.scale_type.name} scales)")
    if rc != 0:
        raise InvalidInput(f"pagedkv CPU attention kernel rejected the arguments (code {rc}): "
                           f"Hq={hq}, H={h}, head_dim={hd}, block_size={layer.block_size}")
    if counters is not None:
        stats["v_rows_read"] = stats.get("v_rows_read", 0) + int(counters[0])
        stats["v_rows_skipped"] = stats.get("v_rows_skipped", 0) + int(counters[1])
    if layer.v_codec.rotated:  # into the query buffer, dead by now: no third [Tq, Hq, D] buffer
        del bias
        out = torch.matmul(out, wht.rotation_matrix(hd, out.device), out=qk)
    if v_centre is not None:
        if not key_start and min(lens.tolist(), default=1) > 0:  # every row's token weights sum to 1
            if q.dtype == torch.float32:
                return out.add_(v_centre)
            # the add and the cast to q's dtype in one op (the same fp32 sum, rounded once)
            return torch.add(out, v_centre, out=torch.empty(tq, hq, hd, dtype=q.dtype))
        else:
            weight = transform.rows_weight_sum(lens, qsl, hq, out.device)
            if key_start:  # a row whose keys all lie before key_start has no weight
                weight = weight * torch.isfinite(lse)
            transform.add_value_centre(layer, out, weight)
    return out.to(q.dtype)


_CENTRES = weakref.WeakKeyDictionary()  # PagedLayer -> (key, k term, v term) (`_centres`)


def _centres(layer: PagedLayer, num_q_heads: int, scale: float):
    """(scale * k_centre, v_centre) float32 [Hq, D] per query head (each kv head's row repeated
    for its GQA group), None where the layer has no such centre: what the logit term and the
    output's centre add take, derived once per layer, not per call (at decode sizes the
    `repeat_interleave`, casts and the scale's multiply cost about as much as the dot itself).
    Rebuilt when the scale or the head count change, or a centre is written in place (seen by
    its version counter; inference tensors have none, and pagedkv never writes a centre)."""
    kc, vc = layer.k_centre, layer.v_centre
    key = (num_q_heads, scale, _written(kc), _written(vc))
    hit = _CENTRES.get(layer)
    if hit is None or hit[0] != key:
        kq = None if kc is None else transform.per_q_head(kc.float(), num_q_heads) * scale
        vq = None if vc is None else transform.per_q_head(vc.float(), num_q_heads).contiguous()
        hit = (key, kq, vq)
        _CENTRES[layer] = hit
    return hit[1], hit[2]


def _written(x: Optional[torch.Tensor]) -> int:
    """How many in-place writes the tensor has seen (0 where torch does not count them)."""
    return 0 if x is None or x.is_inference() else x._version


@functools.lru_cache(maxsize=256)  # a few entries: fp8 K tensor scales differ per layer at most
def _scaled_rotation_t(head_dim: int, scale: float) -> torch.Tensor:
    """R^T * scale [D, D] float32 (q @ it = wht.rotate(q) * scale up to rounding), cached:
    rotating and scaling q is then one matmul per call."""
    return (wht.rotation_matrix(head_dim).T * scale).contiguous()


def _reference_attention(q, layer, block_tables, seq_lens, query_start_loc, params) -> torch.Tensor:
    """The reference ops for the one case the kernel cannot finish (v_centre with sinks needs the
    sinks' weight, which the kernel does not return): decode when every sequence has one query
    (an empty sequence then gives zeros, as in decode), else packed prefill."""
    from .. import reference

    qsl = query_start_loc.long()
    if bool(((qsl[1:] - qsl[:-1]) == 1).all()):
        return reference.decode_attention(q, layer, block_tables, seq_lens, params)
    return reference.prefill_attention(q, layer, block_tables, seq_lens, query_start_loc, params)


PREFILL_QUERY_VECTORS = 96


def _prefill_rows(group: int) -> int:
    """Query rows per prefill task: ~PREFILL_QUERY_VECTORS query vectors (rows x GQA group) share
    each decoded K/V chunk, rounded to a multiple of 6 vectors where possible (the AVX2 tiles
    take 6 query vectors per pass)."""
    rows = max(1, PREFILL_QUERY_VECTORS // group)
    while rows > 1 and (rows * group) % 6:
        rows -= 1
    return rows if (rows * group) % 6 == 0 else max(1, PREFILL_QUERY_VECTORS // group)


PREFILL_TILE_VECTORS = 384


def _prefill_task_rows(group: int) -> int:
    """Query rows per task of the prefill tile (prefill_kernel.h): ~PREFILL_TILE_VECTORS query
    vectors share each decoded K/V chunk (their state, ~200 KB, stays in L2), a multiple of 2 rows
    so that micro-blocks of 6 vectors rarely straddle rows of a GQA group of 3."""
    return max(2, PREFILL_TILE_VECTORS // group) // 2 * 2


def _prefill_tile(kernel, params: AttentionParams, enabled: bool) -> bool:
    """Whether the prefill tile (pkv_prefill, AVX2 and AVX-512 builds) takes this call: no sparse V
    (that stays on the general kernel's prefill path). int8_scores does not keep a prefill call
    from the tile (its integer path is a decode path: the tile's exact scores are the faster way
    through a prefill chunk). bf16_dots picks its entry point (`_prefill_entry`); the general
    kernel uses it only for the scores of tasks of at most 8 query vectors over bf16 / E4M3 keys
    (decode; see pkv_args.bf16_dots), elsewhere it is exact."""
    return enabled and not params.sparse_v_threshold and _prefill_entry(kernel) is not None


@functools.lru_cache(maxsize=None)
def _prefill_entry(kernel, bf16: bool = False):
    """The C entry point pkv_prefill with its argument types (None: a build without the tile);
    bf16: pkv_prefill_bf16 (`AttentionParams.bf16_dots`) where the build has it (AVX-512 BF16),
    else the exact pkv_prefill."""
    fn = getattr(kernel.lib, "pkv_prefill", None)
    if fn is None or not kernel.lib.pkv_prefill_available():
        return None
    if bf16:
        fb = getattr(kernel.lib, "pkv_prefill_bf16", None)
        if fb is not None and kernel.lib.pkv_prefill_bf16_available():
            fn = fb
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Side), ctypes.POINTER(_Side)]
    return fn
