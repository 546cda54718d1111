"""Python side of the fast CPU cache write: describe the codec, rotate if needed, call the C store.

`store(layer, k, v, slot_mapping)` has the reference signature (`pagedkv.ops.reference.store`)
and writes the same bytes: per side, keys multiplied by `layer.k_mult` (in torch, before the C
call) and centred by `layer.k_centre`, values centred by `layer.v_centre`, fp8 divided by its tensor
scale, rows with a negative slot skipped. For a rotated codec the rows are centred and rotated
here in torch exactly as the reference does (same ops on the same kept rows, so the rotated
values are bit-identical); everything else happens in one C call per side (`store_kernel.c`):
dtype conversion, centring, the codec's scale rule and rounding, bit packing, and the write into
the pool block at each slot. No code or scale tensor is built, so a call allocates nothing
besides the rotated copy (and the small slot mask when some slots are negative).

A codec is described to the C store by its catalogue row (`store_desc`): the store kind follows
the row's encode rule (`_KIND`), then code bits, group, scale kind, and for table codecs the
ascending levels, their midpoints and the code of each level (torch's own `sort` of the value
table, as the reference). What the C store encodes is declared in codec traits (`STORE_SUPPORT`:
rules, code widths, groups; every catalogue row), and the dispatcher hands the "cpu" backend no
other row. A call the C store cannot run (a pool without contiguous rows, a head_dim past
MAX_HEAD_DIM, q8_0 / q4_0 rows large enough to saturate the fp16 scale) runs the reference store
for that side, logged once per codec and reason.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ...codecs import wht
from ...codecs.catalogue import Codec, ScaleType
from ...codecs.derive import EncodeRule
from ...codecs.reference import level_order
from ...errors import InvalidInput
from .. import transform
from ..batch import PagedLayer
from ..dispatch import log_fallback_once
from ..reference.store import store_side as reference_store_side
from ..support import CodecSupport, pairs

# store kinds of store_kernel.c, one per encode rule
SK_BF16, SK_E4M3_TENSOR, SK_E4M3_GROUP, SK_INT8, SK_INT_SIGNED, SK_TABLE, SK_F16, SK_E5M2_TENSOR = range(8)
_KIND = {EncodeRule.ROUND_BF16: SK_BF16, EncodeRule.ROUND_FP16: SK_F16, EncodeRule.E4M3_TENSOR: SK_E4M3_TENSOR,
         EncodeRule.E5M2_TENSOR: SK_E5M2_TENSOR, EncodeRule.E4M3_GROUP: SK_E4M3_GROUP,
         EncodeRule.INT_AMAX: SK_INT8, EncodeRule.INT_SIGNED_MAX: SK_INT_SIGNED, EncodeRule.TABLE_SEARCH: SK_TABLE}
MAX_GROUP = 64  # MAX_GROUP in store_kernel.c (groups are multiples of 8)
MAX_TABLE_BITS = 5  # MAX_LEVELS = 32 in store_kernel.c
# What store_kernel.c encodes (its pkv_store checks the same widths): every catalogue row.
STORE_SUPPORT = CodecSupport(
    encode=(pairs(EncodeRule.ROUND_BF16, (16,)) | pairs(EncodeRule.ROUND_FP16, (16,))
            | pairs(EncodeRule.E4M3_TENSOR, (8,)) | pairs(EncodeRule.E5M2_TENSOR, (8,))
            | pairs(EncodeRule.E4M3_GROUP, (8,)) | pairs(EncodeRule.INT_AMAX, (8,))
            | pairs(EncodeRule.INT_SIGNED_MAX, range(2, 8))
            | pairs(EncodeRule.TABLE_SEARCH, range(1, MAX_TABLE_BITS + 1))),
    groups=frozenset(range(0, MAX_GROUP + 1, 8)),
)
_SCALE_KIND = {ScaleType.NONE: 0, ScaleType.TENSOR_FP32: 0, ScaleType.FP8_E4M3: 1,
               ScaleType.BF16: 2, ScaleType.FP16: 3}
_X_DTYPE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MAX_HEAD_DIM = 4096  # MAX_HEAD_DIM in store_kernel.c
def _lane_order_sum(row: list, lanes: int) -> float:
    """The fp32 sum group_sum (store_kernel.c) takes of one row with `lanes`-wide vectors."""
    import numpy as np

    f = np.float32
    g = len(row)
    w = 1 if g < lanes else lanes
    nv = g // w
    ilp = nv // 4
    err = f(0.0)
    for e in range(nv * w, g):
        err = f(err + row[e])
    for e in range(w):
        p = row[e]
        if ilp:
            acc = [row[w * k + e] for k in (1, 2, 3)]
            for j in range(1, ilp):
                p = f(p + row[w * 4 * j + e])
                acc = [f(acc[k - 1] + row[w * (4 * j + k) + e]) for k in (1, 2, 3)]
            for i in range(4 * ilp, nv):
                p = f(p + row[w * i + e])
            for a in acc:
                p = f(p + a)
        else:
            for i in range(1, nv):
                p = f(p + row[w * i + e])
        err = f(err + p)
    return float(err)


@functools.lru_cache(maxsize=None)
def torch_sum_lanes() -> int:
    """Float lanes of the vectors torch's CPU sum runs on here: the order its sums take, which the
    C scale search follows to pick the reference's scale at exact ties (group_sum in
    store_kernel.c). Found by summing terms of wide range both ways: the CPU capability torch
    reports does not decide it (an AVX-512 Zen 4 reports "AVX512" and sums in 8 lanes). Probed
    once, at the first store description, not at import."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 64, generator=gen) * torch.exp(torch.randn(8, 64, generator=gen) * 4)).square()
    want = x.sum(-1).tolist()
    rows = [list(r) for r in x.numpy()]
    preferred = (16, 8) if torch.backends.cpu.get_cpu_capability() == "AVX512" else (8, 16)
    for lanes in preferred:
        if all(_lane_order_sum(r, lanes) == t for r, t in zip(rows, want)):
            return lanes
    return preferred[0]


_p = ctypes.c_void_p
_i32 = ctypes.c_int32
_i64 = ctypes.c_int64
_f32 = ctypes.c_float


class _StoreArgs(ctypes.Structure):
    """Mirror of pkv_store_args in store_kernel.c."""

    _fields_ = [("x", _p), ("centre", _p), ("slots", _p), ("pool", _p), ("levels", _p), ("mids", _p),
                ("order", _p), ("x_stride_t", _i64), ("x_stride_h", _i64), ("num_tokens", _i64),
                ("block_stride", _i64), ("scale_offset", _i64), ("x_dtype", _i32),
                ("block_size", _i32), ("num_heads", _i32), ("head_dim", _i32), ("kind", _i32),
                ("bits", _i32), ("group", _i32), ("scale_kind", _i32), ("row_data_bytes", _i32),
                ("row_scale_bytes", _i32), ("num_levels", _i32), ("sum_lanes", _i32), ("top", _f32),
                ("tensor_scale", _f32)]


@dataclass(frozen=True)
class StoreDesc:
    """How the C store encodes one codec (derived from its catalogue row).

    top: the divisor of the scale rule: max |level| (table codecs, turbo8's 448, q8_0's 127),
    or -min level for int4 (q4_0's 8). levels / mids float32 [L] / [L-1] ascending and order
    uint8 [L] (code of each level) for table codecs, else empty.
    """

    kind: int
    bits: int
    group: int
    scale_kind: int
    top: float
    levels: torch.Tensor
    mids: torch.Tensor
    order: torch.Tensor


def _empty(dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(1, dtype=dtype)


@functools.lru_cache(maxsize=None)
def store_desc(codec: Codec) -> Optional[StoreDesc]:
    """The C store's description of `codec` (from the row's derived traits), or None for a row
    `STORE_SUPPORT` does not declare (the dispatcher gives those to another backend)."""
    if STORE_SUPPORT.refusal(codec, store=True) is not None:
        return None
    t = codec.traits
    kind, sk = _KIND[t.encode], _SCALE_KIND[t.scale]
    table = codec.value_table()
    none = (_empty(), _empty(), _empty(torch.uint8))
    if kind == SK_TABLE:
        levels, order = level_order(table)  # the reference's order of equal levels (E2M1 +-0)
        mids = (levels[1:] + levels[:-1]) / 2
        return StoreDesc(kind, t.bits, t.group, sk, float(levels.abs().max()), levels.contiguous(),
                         mids.contiguous(), order.to(torch.uint8).contiguous())
    if kind == SK_INT_SIGNED:
        return StoreDesc(kind, t.bits, t.group, sk, float(-table.min()), *none)
    top = float(table.max()) if kind in (SK_E4M3_GROUP, SK_INT8) else 1.0
    return StoreDesc(kind, t.bits, t.group, sk, top, *none)


@dataclass(frozen=True)
class _SidePlan:
    """What a store call needs of one codec at one layer geometry, derived once (`_side_plan`):
    the catalogue lookups (traits, support, description) cost more per call than the C store
    itself at decode sizes (a few tokens), so a call only fills in its tensors' pointers.

    why: why the C store cannot take this codec / geometry (None: it can; the pool's own device
    and layout are checked per call). saturable: an integer codec, whose half-precision group
    scale each call range-checks (`_scale_would_saturate`). rotation_t: R^T float32 [D, D] (the
    very view `wht.rotate` multiplies by) for a rotated codec, else None. args: the C arguments
    with every codec- and geometry-derived field set (None where `why`)."""

    why: Optional[str]
    saturable: bool
    rotation_t: Optional[torch.Tensor]
    args: Optional[_StoreArgs]


_PLANS: dict = {}  # (id(codec), block size, H, D) -> (codec, _SidePlan)
_MAX_PLANS = 256  # a handful in practice (codec x geometry); cleared past this, never unbounded


def _side_plan(codec: Codec, layer: PagedLayer) -> _SidePlan:
    """The cached `_SidePlan` of `codec` at the layer's geometry (keyed by the codec's identity:
    hashing a catalogue row costs microseconds; the codec is kept, so its id is not reused)."""
    key = (id(codec), layer.block_size, layer.num_kv_heads, layer.head_dim)
    hit = _PLANS.get(key)
    if hit is None or hit[0] is not codec:
        hit = (codec, _make_plan(codec, *key[1:]))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = hit
    return hit[1]


def _make_plan(codec: Codec, block_size: int, num_heads: int, head_dim: int) -> _SidePlan:
    why = STORE_SUPPORT.refusal(codec, store=True)
    if why is None and head_dim > MAX_HEAD_DIM:
        why = f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    saturable = _int_scaled(codec)
    rotation_t = wht.rotation_matrix(head_dim).T if codec.rotated else None
    if why is not None:
        return _SidePlan(why, saturable, rotation_t, None)
    d = store_desc(codec)
    a = _StoreArgs()
    a.levels, a.mids, a.order = d.levels.data_ptr(), d.mids.data_ptr(), d.order.data_ptr()
    a.scale_offset = codec.data_bytes(block_size * num_heads * head_dim)
    a.block_size, a.num_heads, a.head_dim = block_size, num_heads, head_dim
    a.kind, a.bits, a.group, a.scale_kind = d.kind, d.bits, d.group, d.scale_kind
    a.row_data_bytes = codec.row_data_bytes(head_dim)
    a.row_scale_bytes = codec.row_scale_bytes(head_dim)
    a.num_levels = d.levels.numel() if d.kind == SK_TABLE else 0
    a.sum_lanes = torch_sum_lanes()
    a.top = d.top
    return _SidePlan(None, saturable, rotation_t, a)


def _pool_refusal(pool: torch.Tensor) -> Optional[str]:
    """Why the C store cannot write this pool (None: it can)."""
    if pool.device.type != "cpu":
        return f"the pool is on {pool.device.type}"
    if pool.stride(1) != 1:
        return "the pool's rows are not byte-contiguous"
    return None


def _int_scaled(codec: Codec) -> bool:
    """An integer codec (q8_0, q4_0): its half-precision group scale grows with |x| and can saturate."""
    return codec.traits.encode in (EncodeRule.INT_AMAX, EncodeRule.INT_SIGNED_MAX)


def _scale_would_saturate(codec: Codec, x: torch.Tensor, centre: Optional[torch.Tensor]) -> bool:
    """True when an integer codec's fp16 group scale could pass 65504 for these rows: the
    reference encoder saturates it (store_kernel.c does not), so such a call runs the reference
    store. One min/max pass over x; conservative (|x| + |centre|), identical bytes either way."""
    t = codec.traits
    if not _int_scaled(codec) or x.numel() == 0:
        return False
    limit = torch.finfo(torch.float16 if t.scale is ScaleType.FP16 else torch.bfloat16).max
    limit *= (1 << (t.bits - 1)) - 1 if t.encode is EncodeRule.INT_AMAX else (1 << (t.bits - 1))
    lo, hi = torch.aminmax(x.detach())
    big = max(-float(lo), float(hi)) + (float(centre.abs().max()) if centre is not None else 0.0)
    return not big < limit  # NaN/Inf too: the reference raises the clear error


def store_side(lib, layer: PagedLayer, codec: Codec, pool: torch.Tensor, scale: torch.Tensor,
               x: torch.Tensor, centre: Optional[torch.Tensor], slots: torch.Tensor, every: bool) -> None:
    """Encode x float [T, H, D] (minus `centre` [H, D] if given) into `pool` at `slots` (int64
    [T], contiguous; `every`: no slot is negative, as `store` finds once for both sides)."""
    plan = _side_plan(codec, layer)
    why = plan.why or _pool_refusal(pool)
    if why is None and plan.saturable and _scale_would_saturate(codec, x, centre):
        why = "rows at or past the range of the half-precision group scale (or not finite)"
    if why is not None:
        log_fallback_once(f"the CPU store of {codec.name}", why, "reference store")
    runs = why is None
    if not runs or codec.rotated:  # centred in torch, exactly as the reference store does
        xf = x.float()
        if centre is not None:
            xf = xf - centre.to(xf.device, torch.float32)
        if not runs:
            reference_store_side(layer, codec, pool, scale, xf, slots)
            return
    if slots.numel() == 0:
        return
    tensor_scale = 1.0
    if codec.scale_type is ScaleType.TENSOR_FP32:
        tensor_scale = float(scale.reshape(-1)[0])
    if codec.rotated:  # exactly the reference's ops: centre (above), keep, rotate (wht.rotate's product)
        if not every:
            keep = slots >= 0
            slots = slots[keep]
            if slots.numel() == 0:
                return
            xf = xf[keep]
        x, centre = xf @ plan.rotation_t, None
    elif not every and not bool((slots >= 0).any()):
        return
    if codec.scale_type is ScaleType.TENSOR_FP32 and not tensor_scale > 0:
        raise InvalidInput(f"fp8 tensor_scale must be > 0, got {tensor_scale!r}")
    if x.dtype not in _X_DTYPE or x.stride(-1) != 1:
        x = x.float().contiguous()
    if centre is not None:
        centre = centre.to(torch.float32).contiguous()

    a = _StoreArgs.from_buffer_copy(plan.args)  # a copy: concurrent calls never share one
    a.x, a.slots, a.pool = x.data_ptr(), slots.data_ptr(), pool.data_ptr()
    a.centre = centre.data_ptr() if centre is not None else None
    a.x_stride_t, a.x_stride_h, a.num_tokens = x.stride(0), x.stride(1), slots.shape[0]
    a.block_stride = pool.stride(0)
    a.x_dtype = _X_DTYPE[x.dtype]
    a.tensor_scale = tensor_scale
    rc = lib.pkv_store(ctypes.byref(a))
    if rc == 1:
        raise InvalidInput(f"{codec.name} encode got NaN or Inf values")
    if rc == 3:
        raise InvalidInput(f"the CPU store kernel does not implement {codec.code_bits}-bit codes ({codec.name})")
    if rc != 0:
        raise InvalidInput(f"pagedkv CPU store kernel rejected the arguments (code {rc}): codec={codec.name}, "
                           f"H={layer.num_kv_heads}, head_dim={layer.head_dim}, block_size={layer.block_size}")


def store(lib, layer: PagedLayer, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
          slot_mapping: torch.Tensor) -> None:
    """Reference-signature store (plus the loaded library): K side first, then V. The slots were
    checked before (`validate.check_store`, the one owner of the slot checks: int64 [T], below the
    pool's capacity, no slot twice; negative = skip), as the C store trusts them; here they are
    made int64 (a direct call's) and contiguous for the C call, and read for negatives once for
    both sides, which picks the rows to encode (as the reference's keep mask does), not a check."""
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    slots = slots.contiguous()
    every = slots.numel() == 0 or int(slots.min()) >= 0
    if k is not None:
        store_side(lib, layer, layer.k_codec, layer.k_pool, layer.k_scale, transform.keys_to_store(layer, k),
                   layer.k_centre, slots, every)
    if v is not None:
        store_side(lib, layer, layer.v_codec, layer.v_pool, layer.v_scale, v, layer.v_centre, slots, every)
