"""Input checks of the public ops: every bad tensor raises InvalidInput naming the argument.

Metadata checks (type, dtype, shape, device) always run and cost nothing. Index checks (slot,
block-id, length and query-offset ranges: one min / max per index tensor) keep the kernels
inside their buffers; value checks (NaN/Inf in k/v/q and the transform, duplicate slots) scan
data. Both read tensor values, which on a GPU is a host sync, so `checks=False` skips them
there and the Triton kernels mask and clamp every index instead (memory-safe, garbage in,
garbage out); on other devices the index checks cost no sync and always run, since the C
kernels trust them (`checks=False` never turns a bad index into a wild read or write).

What the ops cannot know: which slots a sequence owns. A slot inside the pool but in another
sequence's block (or below a block's committed fill, or stale after free and reuse) is written
as asked; the block manager (`alloc/`, the cache) hands out slots and owns that invariant.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import InvalidInput
from . import transform
from .batch import AttentionParams, PagedLayer

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, x, *, dtypes, dim: int, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise InvalidInput(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise InvalidInput(f"{name} must have dtype {_names(dtypes)}, got {str(x.dtype).replace('torch.', '')}")
    if x.dim() != dim:
        raise InvalidInput(f"{name} must have {dim} dims, got shape {tuple(x.shape)}")
    if x.device != device:
        raise InvalidInput(f"{name} is on {x.device} but the layer's pools are on {device}")


def check_finite(name: str, x: torch.Tensor) -> None:
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise InvalidInput(f"{name} holds NaN or Inf values")


def check_layer(layer, values: bool = False) -> None:
    """Types, shapes and devices of the layer's tensors; with `values`, the transform's values."""
    if not isinstance(layer, PagedLayer):
        raise InvalidInput(f"layer must be a PagedLayer, got {type(layer).__name__}")
    dev = layer.k_pool.device
    for side, pool, codec in (("k", layer.k_pool, layer.k_codec), ("v", layer.v_pool, layer.v_codec)):
        want = codec.block_bytes(layer.block_size, layer.num_kv_heads, layer.head_dim)
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] != want:
            raise InvalidInput(
                f"layer.{side}_pool must be uint8 [num_blocks, {want}] for codec {codec.name} "
                f"(block_size {layer.block_size}, {layer.num_kv_heads} kv heads, head_dim "
                f"{layer.head_dim}), got {pool.dtype} {tuple(pool.shape)}"
            )
        if pool.device != dev:
            raise InvalidInput(f"layer.{side}_pool is on {pool.device}, layer.k_pool on {dev}")
    if layer.v_pool.shape[0] != layer.k_pool.shape[0]:
        raise InvalidInput(
            f"layer.k_pool and layer.v_pool must have the same number of blocks, got "
            f"{layer.k_pool.shape[0]} and {layer.v_pool.shape[0]}"
        )
    for side in ("k_scale", "v_scale"):
        s = getattr(layer, side)
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
            raise InvalidInput(f"layer.{side} must be a float32 [1] tensor, got {s!r}")
    for name in ("k_centre", "k_mult", "v_centre"):
        c = getattr(layer, name)
        if c is None:
            continue
        if (not isinstance(c, torch.Tensor) or c.dtype != torch.float32
                or tuple(c.shape) != (layer.num_kv_heads, layer.head_dim) or c.device != dev):
            raise InvalidInput(
                f"layer.{name} must be None or float32 [{layer.num_kv_heads}, {layer.head_dim}] on "
                f"{dev}, got {getattr(c, 'dtype', type(c))} {tuple(getattr(c, 'shape', ()))}"
            )
    if values:
        why = transform.check_values(layer)
        if why is not None:
            raise InvalidInput(why)


def index_checks(values: bool, device: torch.device) -> bool:
    """Whether the index checks run: always, except on CUDA with checks off (kernels clamp)."""
    return values or device.type != "cuda"


def check_store(layer: PagedLayer, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                slot_mapping: torch.Tensor, values: bool) -> Optional[bool]:
    """Refuse a bad store before anything is written: the layer, k / v, and the slots (int64
    [T]; with the index checks every slot below the pools' capacity, negative = skip; with
    `values` no slot twice and k / v finite where stored). Returns whether no slot is negative
    (None where the index checks did not run), read once with the range, for
    `check_store_finite`."""
    check_layer(layer, values)
    dev = layer.device
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int64,), dim=1, device=dev)
    t = slot_mapping.shape[0]
    shape = (t, layer.num_kv_heads, layer.head_dim)
    for name, x in (("k", k), ("v", v)):
        if x is None:
            continue
        check_tensor(name, x, dtypes=FLOAT_DTYPES, dim=3, device=dev)
        if tuple(x.shape) != shape:
            raise InvalidInput(f"{name} must have shape [T, num_kv_heads, head_dim] = {list(shape)}, got {list(x.shape)}")
    every = None  # no negative (skipped) slot; read once here, with the range
    if t and index_checks(values, dev):
        lo, hi = _min_max(slot_mapping)
        every = lo >= 0
        capacity = layer.num_blocks * layer.block_size
        if hi >= capacity:
            raise InvalidInput(
                f"slot_mapping holds slot {hi} but the pools have {capacity} slots "
                f"({layer.num_blocks} blocks x {layer.block_size}); negative slots mean skip"
            )
    if values:
        check_store_finite(k, v, slot_mapping, every)
        if t:
            used = slot_mapping if every else slot_mapping[slot_mapping >= 0]
            if used.unique().numel() != used.numel():
                slots, counts = used.unique(return_counts=True)
                raise InvalidInput(f"slot_mapping writes the same slot twice (slot {int(slots[counts > 1][0])}); "
                                   "each new token needs its own slot")
    return every


def check_store_finite(k: Optional[torch.Tensor], v: Optional[torch.Tensor], slot_mapping: torch.Tensor,
                       every: Optional[bool] = None) -> None:
    """NaN/Inf in a row that will be stored; rows with a negative slot (padding) are skipped, not
    scanned. every: whether no slot is negative, when the caller has read it (`check_store`);
    None: read here.

    Each side is first summed (fp32): a finite sum proves every element finite (NaN and +-Inf
    survive any order of additions), and one reduction costs a fraction of `isfinite` + `all` at
    decode sizes, where this runs once per layer and step. The element-wise scan runs only when a
    sum is not finite: bad input (raised as before), or finite rows whose sum overflows (passed)."""
    every = None
    for name, x in (("k", k), ("v", v)):
        if x is None or not x.numel():
            continue
        if every is None:
            every = not slot_mapping.numel() or int(slot_mapping.min()) >= 0
        rows = x if every else x[slot_mapping >= 0]
        if not math.isfinite(float(rows.sum(dtype=torch.float32))):
            check_finite(name, rows)


def check_params(params, num_q_heads: int, device: torch.device) -> None:
    if not isinstance(params, AttentionParams):
        raise InvalidInput(f"params must be an AttentionParams, got {type(params).__name__}")
    if not (isinstance(params.scale, (int, float)) and params.scale > 0 and params.scale < float("inf")):
        raise InvalidInput(f"params.scale must be a finite number > 0, got {params.scale!r}")
    w = params.sliding_window
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise InvalidInput(f"params.sliding_window must be None or an int >= 1, got {w!r}")
    c = params.soft_cap
    if c is not None and not (isinstance(c, (int, float)) and 0 < c < float("inf")):
        raise InvalidInput(f"params.soft_cap must be None or a finite number > 0, got {c!r}")
    t = params.sparse_v_threshold
    if not (isinstance(t, (int, float)) and 0.0 <= t < 1.0):
        raise InvalidInput(f"params.sparse_v_threshold must be in [0, 1), got {t!r}")
    if not isinstance(params.int8_scores, bool):
        raise InvalidInput(f"params.int8_scores must be True or False, got {params.int8_scores!r}")
    if not isinstance(params.bf16_dots, bool):
        raise InvalidInput(f"params.bf16_dots must be True or False, got {params.bf16_dots!r}")
    if params.sinks is not None:
        check_tensor("params.sinks", params.sinks, dtypes=(torch.float32,), dim=1, device=device)
        if params.sinks.shape[0] != num_q_heads:
            raise InvalidInput(f"params.sinks must have shape [{num_q_heads}] (one per q head), got {list(params.sinks.shape)}")
        check_finite("params.sinks", params.sinks)


def _check_q(q, layer: PagedLayer) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, dim=3, device=layer.device)
    if q.shape[2] != layer.head_dim:
        raise InvalidInput(f"q has head_dim {q.shape[2]}, the layer stores head_dim {layer.head_dim}")
    if q.shape[1] % layer.num_kv_heads:
        raise InvalidInput(
            f"q has {q.shape[1]} heads, not a multiple of the layer's {layer.num_kv_heads} kv heads"
        )


def _check_tables(layer: PagedLayer, block_tables, seq_lens, batch: int, values: bool) -> None:
    dev = layer.device
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), dim=2, device=dev)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), dim=1, device=dev)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise InvalidInput(
            f"block_tables {list(block_tables.shape)} and seq_lens {list(seq_lens.shape)} must both "
            f"have {batch} rows (one per sequence)"
        )
    if batch and index_checks(values, dev):
        lo, hi = _min_max(seq_lens)
        cap = block_tables.shape[1] * layer.block_size
        if lo < 0 or hi > cap:
            raise InvalidInput(
                f"seq_lens must be in [0, {cap}] (block_tables width {block_tables.shape[1]} x "
                f"block_size {layer.block_size}), got values in [{lo}, {hi}]"
            )
        if block_tables.numel() == 0:
            return
        lo, hi = _min_max(block_tables)  # usually enough: every entry, used or not, is in range
        if lo < 0 or hi >= layer.num_blocks:  # then look at the used entries only
            used = torch.arange(block_tables.shape[1], device=dev)[None, :] * layer.block_size < seq_lens[:, None]
            ids = block_tables[used]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= layer.num_blocks):
                raise InvalidInput(
                    f"block_tables hold block ids in [{int(ids.min())}, {int(ids.max())}] for the used "
                    f"blocks; the pools have {layer.num_blocks} blocks"
                )


def _min_max(x: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty integer tensor: through numpy on the CPU (a few microseconds,
    which keeps the always-on index checks cheap per layer call), else one aminmax."""
    if x.device.type == "cpu":
        a = x.numpy()
        return int(a.min()), int(a.max())
    lo, hi = torch.aminmax(x)
    return int(lo), int(hi)


def check_decode(q, layer, block_tables, seq_lens, params, values: bool) -> None:
    check_layer(layer, values)
    _check_q(q, layer)
    _check_tables(layer, block_tables, seq_lens, q.shape[0], values)
    check_params(params, q.shape[1], layer.device)
    if values:
        check_finite("q", q)


def check_prefill(q, layer, block_tables, seq_lens, query_start_loc, params, values: bool) -> None:
    check_layer(layer, values)
    _check_q(q, layer)
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), dim=1, device=layer.device)
    batch = seq_lens.shape[0]
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), dim=1, device=layer.device)
    if query_start_loc.shape[0] != batch + 1:
        raise InvalidInput(
            f"query_start_loc must have B+1 = {batch + 1} entries for {batch} sequences, got "
            f"{query_start_loc.shape[0]}"
        )
    _check_tables(layer, block_tables, seq_lens, batch, values)
    check_params(params, q.shape[1], layer.device)
    if values:
        check_finite("q", q)
    if index_checks(values, layer.device):
        starts = query_start_loc.long()
        q_lens = starts[1:] - starts[:-1]
        if int(starts[0]) != 0 or int(starts[-1]) != q.shape[0] or bool((q_lens < 0).any()):
            raise InvalidInput(
                f"query_start_loc must start at 0, never decrease and end at Tq = {q.shape[0]}, "
                f"got {query_start_loc.tolist()}"
            )
        if bool((q_lens > seq_lens.long()).any()):
            raise InvalidInput(
                f"a sequence has more queries than tokens: query lengths {q_lens.tolist()}, "
                f"seq_lens {seq_lens.tolist()} (seq_lens include the new tokens)"
            )
