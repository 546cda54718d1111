"""One model layer of the transformers drop-in (transformers' CacheLayerMixin contract): its
pools (applied plan steps), its first-chunk statistics, and the chunk `update` hands over to the
attention function, which stores it at the block manager's slots (`hf_rows.RowStorage`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

import torch

from ..options import centres_values, scales_keys
from ..errors import InvalidInput
from ..heap import release_free_heap
from ..cache.storage import apply_group_step, build_layer, build_tail
from ..ops import PagedLayer, store
from ..ops.validate import check_store
from ..cache.calibration import CalibrationOptions, calibrate
from .hf_common import _TAG, GroupView, _concrete_class, _transformers
from .padding import valid_tokens as _valid_tokens

if TYPE_CHECKING:
    from .transformers import PagedKVCache


class PagedCacheLayer:
    """One model layer's paged K/V (transformers CacheLayerMixin contract).

    `length`: columns processed (pads included, as transformers counts); row r holds
    `cache.row_lengths(length)[r]` valid tokens. `pending`: (k, v, start column) of the chunk
    `update` received, stored by the attention function once it knows the chunk's padding.
    `paged`: the ops' PagedLayer (pools, codecs, fp8 scales, key centre), rebuilt when the pools
    grow or the centre is fixed.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __new__(cls, *args, **kwargs):
        _, cache_utils = _transformers()
        return object.__new__(_concrete_class(cls, cache_utils.CacheLayerMixin))

    def __init__(self, cache: PagedKVCache, spec):
        self.keys = None
        self.values = None
        self.is_initialized = False
        self.cache = cache
        self.spec = spec
        self.sliding_window = spec.sliding_window
        self.is_sliding = spec.sliding_window is not None
        self.length = 0
        self.paged: Optional[PagedLayer] = None
        self.tail: Optional[PagedLayer] = None  # the high-precision recent window (cache.recent_window)
        self.k_mult: Optional[torch.Tensor] = None  # float32 [H, D]: stored keys are k * k_mult
        self.pending = None  # (k, v, start column) of the chunk waiting for the attention function
        self.scale_keys = scales_keys(spec.format, cache.key_scaling)
        self.centre_values = centres_values(spec.format, cache.value_centring)
        self.v_centre: Optional[torch.Tensor] = None  # float32 [H, D]
        self.device = cache.config.device
        self.group: GroupView = cache._group_of[spec.index]

    def __repr__(self):
        return f"PagedCacheLayer({self.spec.index}, {self.spec.format.name}, len={self.length})"

    # pools ---------------------------------------------------------------------------------
    def _make(self, num_blocks: int) -> PagedLayer:
        return build_layer(self.spec, num_blocks, self.cache.config.block_size, self.device)

    def _make_tail(self) -> None:
        """The recent window's tail (`cache.storage.build_tail`): the tail codec on both sides,
        this layer's transform, pools in the cache's tail block group (window R: only the blocks
        covering each row's last R positions are held)."""
        recent = self.cache.recent_window
        if recent is None:
            return
        self.tail = build_tail(self.paged, recent.codec, self.cache.tail_group.num_blocks)

    def transform(self) -> dict:
        """The layer's stored-bytes transform (float32 tensors or None), see calibration."""
        p = self.paged
        return {"k_centre": p.k_centre, "k_mult": self.k_mult, "v_centre": self.v_centre,
                "k_scale": p.k_scale, "v_scale": p.v_scale}

    def transform_shapes(self) -> dict:
        hd = (self.spec.num_kv_heads, self.spec.head_dim)
        return {"k_centre": hd, "k_mult": hd, "v_centre": hd, "k_scale": (1,), "v_scale": (1,)}

    def adopt(self, t: dict) -> None:
        """Initialize from a stored transform (a shared prefix store's) instead of fitting one."""
        dev = self.device
        p = self._make(self.group.num_blocks)
        on = {k: (None if v is None else v.to(dev, torch.float32)) for k, v in t.items()}
        self.k_mult, self.v_centre = on["k_mult"], on["v_centre"]
        self.paged = replace(p, k_centre=on["k_centre"], k_mult=on["k_mult"], v_centre=on["v_centre"],
                             k_scale=on["k_scale"] if on["k_scale"] is not None else p.k_scale,
                             v_scale=on["v_scale"] if on["v_scale"] is not None else p.v_scale)
        self._make_tail()
        self.is_initialized = True

    def _apply(self, step) -> None:
        """Apply one group step of the block manager's plan to this layer's pools: moves then
        a cut (new tensors, so the memory is returned), or growth; then copy-on-write."""
        if self.paged is not None:
            self.paged = self._applied(self.paged, step)

    def _apply_tail(self, step) -> None:
        """`_apply` for the recent window's tail (its own block group)."""
        if self.tail is not None:
            self.tail = self._applied(self.tail, step)

    def _applied(self, p: PagedLayer, step) -> PagedLayer:
        return apply_group_step(p, step)

    def pool_bytes(self) -> int:
        if self.paged is None:
            return 0
        p = self.paged
        extra = 8 + (0 if p.k_centre is None else p.k_centre.numel() * 4)
        extra += 0 if self.k_mult is None else self.k_mult.numel() * 4
        extra += 0 if self.v_centre is None else self.v_centre.numel() * 4
        if self.tail is not None:
            extra += self.tail.k_pool.numel() + self.tail.v_pool.numel()
        return p.k_pool.numel() + p.v_pool.numel() + extra

    # contract -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            query_states: Optional[torch.Tensor] = None) -> None:
        """Fix the pools, the key centre, the key channel multipliers and the fp8 tensor scales
        from the first chunk (keys/values float [B, H, T, D], queries [B, Hq, T, D] or None)."""
        s = self.spec
        if key_states.shape[1] != s.num_kv_heads or key_states.shape[-1] != s.head_dim:
            raise InvalidInput(
                f"layer {s.index}: keys {tuple(key_states.shape)} do not match the cache's "
                f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}"
            )
        p = self._make(self.group.num_blocks)
        options = CalibrationOptions(key_centring=self.cache.key_centring, key_scaling=self.scale_keys,
                                     value_centring=self.centre_values)
        cal = calibrate(key_states, value_states, query_states, p.k_codec.name, p.v_codec.name,
                        options, p.device)
        self.k_mult, self.v_centre = cal.k_mult, cal.v_centre
        # the whole transform goes into the layer the ops receive: they store and attend with it
        changes = {name: getattr(cal, name) for name in ("k_centre", "k_scale", "v_scale",
                                                         "k_mult", "v_centre")
                   if getattr(cal, name) is not None}
        self.paged = replace(p, **changes) if changes else p
        self._make_tail()
        self.is_initialized = True
        release_free_heap()  # the statistics' one-time temporaries would stay as heap holes,
        # accumulating over the first chunk's layers (~1-1.5 MB on SmolLM2, the turbo3 run's peak)

    def _store_chunk(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int,
                     valid: Optional[torch.Tensor] = None,
                     query_states: Optional[torch.Tensor] = None) -> None:
        """Store the valid tokens of the chunk at columns start.. (keys/values float [B, H, T, D];
        valid bool [B, T] or None = all), packed per row after the row's stored tokens. The
        layer's first chunk with a valid token fixes its statistics from the valid tokens (and
        the valid queries [B, Hq, T, D], when given) first."""
        b, h, t, d = key_states.shape
        cache = self.cache
        starts = cache.row_lengths(start)
        counts = [t] * b if valid is None else valid.sum(dim=1).tolist()
        if sum(counts):
            if not self.is_initialized:
                q = None if query_states is None else _valid_tokens(query_states, valid, counts)
                self.lazy_initialization(_valid_tokens(key_states, valid, counts),
                                         _valid_tokens(value_states, valid, counts), q)
            k = key_states.transpose(1, 2)  # [B, T, H, D]
            v = value_states.transpose(1, 2)
            k = k.reshape(b * t, h, d) if valid is None else k[valid]
            v = v.reshape(b * t, h, d) if valid is None else v[valid]
            slots = cache._slots_rows(starts, counts, self.paged.device, self.group, valid)
            if self.tail is not None:  # the tail's own slots; its inputs checked before any write
                tail_slots = cache._slots_rows(starts, counts, self.paged.device, cache.tail_group, valid)
                check_store(self.tail, k, v, tail_slots, True)
            store(self.paged, k, v, slots, backend=cache.backend, checks=cache.checks)
            if self.tail is not None:
                store(self.tail, k, v, tail_slots, backend=cache.backend, checks=cache.checks)
        cache._record(start, valid, b, t)

    def flush(self, query_states: Optional[torch.Tensor] = None,
              valid: Optional[torch.Tensor] = None) -> None:
        """Store the chunk `update` left for the attention function (every token valid unless
        `valid` bool [B, T] says otherwise; queries [B, Hq, T, D] for the key statistics)."""
        if self.pending is None:
            return
        k, v, start = self.pending
        self.pending = None
        self._store_chunk(k, v, start, valid, query_states)

    def _abort(self, pending, was_initialized: bool) -> None:
        """Forget the chunk `pending` (k, v, start) that the attention function refused or failed
        to store, so the layer is as it was before `update` (statistics a failed first chunk
        fixed are dropped too)."""
        if pending is None:
            return
        self.pending = None
        self.length = pending[2]
        if not was_initialized:
            self.paged, self.k_mult, self.v_centre, self.is_initialized = None, None, None, False
            self.tail = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take the new tokens' K/V (float [B, H, T, D]); return them tagged with this layer for
        the attention function. Nothing is stored here: the attention function receives the
        chunk's padding mask, then stores the valid tokens compressed (`flush`) and attends
        (a chunk the attention function never saw is stored whole by the next `update`)."""
        s = self.spec
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise InvalidInput(
                f"layer {s.index}: expected keys and values [B, H, T, D] of one shape, got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.shape[1] != s.num_kv_heads or key_states.shape[-1] != s.head_dim:
            raise InvalidInput(
                f"layer {s.index}: keys {tuple(key_states.shape)} do not match the cache's "
                f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}"
            )
        b, h, t, d = key_states.shape
        self.cache._ensure_rows(b)
        self.flush()  # attention never ran for the previous chunk: store it whole
        if t:
            self.pending = (key_states, value_states, self.length)
            self.length += t
        setattr(key_states, _TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.paged = None
        self.tail = None
        self.k_mult = None
        self.v_centre = None
        self.pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:  # the cache crops all layers together
        self.cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        self.cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self.cache.batch_select_indices(indices)

    def offload(self):  # pools stay where they are
        pass

    def prefetch(self):
        pass
