"""One model layer of the transformers drop-in (transformers' CacheLayerMixin contract): the
chunk `update` hands over to the attention function, which stores it through the engine cache
(`pagedkv.cache.PagedCache`: the layer's first chunk fits its transform there, `fit_layer`) and
attends through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..errors import InvalidInput
from ..heap import release_free_heap
from ..ops import PagedLayer
from .hf_common import _TAG, GroupView, _concrete_class, _transformers
from .padding import pack, valid_tokens as _valid_tokens

if TYPE_CHECKING:
    from .transformers import PagedKVCache


class PagedCacheLayer:
    """One model layer's paged K/V (transformers CacheLayerMixin contract).

    `length`: columns processed (pads included, as transformers counts); row r holds
    `cache.row_lengths(length)[r]` valid tokens. `pending`: (k, v, start column) of the chunk
    `update` received, stored by the attention function once it knows the chunk's padding.
    `paged` / `tail`: the engine's PagedLayer of this layer and its recent-window tail (None
    until the first chunk fixed the layer's transform).
    """

    is_compileable = False  # the cache's too: transformers' Cache.is_compileable reads its layers'
    is_croppable = True
    supports_early_init = False

    def __new__(cls, *args, **kwargs):
        _, cache_utils = _transformers()
        return object.__new__(_concrete_class(cls, cache_utils.CacheLayerMixin))

    def __init__(self, cache: PagedKVCache, spec):
        self.keys = None
        self.values = None
        self.cache = cache
        self.spec = spec
        self.index = spec.index
        self.sliding_window = spec.sliding_window
        self.is_sliding = spec.sliding_window is not None
        self.length = 0
        self.pending = None  # (k, v, start column) of the chunk waiting for the attention function
        self.device = cache.config.device
        self.group: GroupView = cache._group_of[spec.index]

    def __repr__(self):
        return f"PagedCacheLayer({self.spec.index}, {self.spec.format.name}, len={self.length})"

    # the engine's state of this layer -------------------------------------------------------
    @property
    def is_initialized(self) -> bool:
        """Whether the layer's transform is fixed (fitted to its first chunk, or adopted)."""
        return self.index in self.cache.engine.fitted

    @property
    def paged(self) -> Optional[PagedLayer]:
        return self.cache.engine.layers[self.index] if self.is_initialized else None

    @property
    def tail(self) -> Optional[PagedLayer]:
        tails = self.cache.engine.tails
        return tails[self.index] if tails is not None and self.is_initialized else None

    @property
    def k_mult(self) -> Optional[torch.Tensor]:
        """float32 [H, D]: stored keys are k * k_mult (None: no multipliers)."""
        return None if self.paged is None else self.paged.k_mult

    @property
    def v_centre(self) -> Optional[torch.Tensor]:
        return None if self.paged is None else self.paged.v_centre

    def pool_bytes(self) -> int:
        p = self.paged
        if p is None:
            return 0
        extra = 8 + sum(0 if t is None else t.numel() * 4 for t in (p.k_centre, p.k_mult, p.v_centre))
        if self.tail is not None:
            extra += self.tail.k_pool.numel() + self.tail.v_pool.numel()
        return p.k_pool.numel() + p.v_pool.numel() + extra

    def _check_dims(self, key_states: torch.Tensor) -> None:
        s = self.spec
        if key_states.shape[1] != s.num_kv_heads or key_states.shape[-1] != s.head_dim:
            raise InvalidInput(
                f"layer {s.index}: keys {tuple(key_states.shape)} do not match the cache's "
                f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}"
            )

    # contract -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            query_states: Optional[torch.Tensor] = None, has_sinks: bool = False) -> None:
        """Fix the layer's transform (key centre and multipliers, value centre, fp8 scales) from
        its first chunk (keys/values float [B, H, T, D], queries [B, Hq, T, D] or None), in the
        engine (`PagedCache.fit_layer`)."""
        self._check_dims(key_states)
        cache = self.cache
        cache.engine.fit_layer(self.index, key_states, value_states, query_states,
                               options=cache.options, has_sinks=has_sinks)
        release_free_heap()  # the statistics' one-time temporaries would stay as heap holes,
        # accumulating over the first chunk's layers (~1-1.5 MB on SmolLM2, the turbo3 run's peak)

    def _store_chunk(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int,
                     valid: Optional[torch.Tensor] = None,
                     query_states: Optional[torch.Tensor] = None, has_sinks: bool = False) -> None:
        """Store the valid tokens of the chunk at columns start.. (keys/values float [B, H, T, D];
        valid bool [B, T] or None = all), packed per row after the row's stored tokens. The
        layer's first chunk with a valid token fixes its transform from the valid tokens (and
        the valid queries [B, Hq, T, D], when given) first (`PagedCache.fit_layer`)."""
        cache = self.cache

        def write(counts, step):
            if not self.is_initialized:
                q = None if query_states is None else _valid_tokens(query_states, valid, counts)
                self.lazy_initialization(_valid_tokens(key_states, valid, counts),
                                         _valid_tokens(value_states, valid, counts), q, has_sinks)
            k, v = pack(key_states.transpose(1, 2), valid), pack(value_states.transpose(1, 2), valid)
            cache.engine.store(self.index, k, v, step(), backend=cache.backend, checks=cache.checks)

        cache.rows.store(start, valid, key_states.shape[0], key_states.shape[2], write)

    def flush(self, query_states: Optional[torch.Tensor] = None,
              valid: Optional[torch.Tensor] = None, has_sinks: bool = False) -> None:
        """Store the chunk `update` left for the attention function (every token valid unless
        `valid` bool [B, T] says otherwise; queries [B, Hq, T, D] for the key statistics)."""
        if self.pending is None:
            return
        k, v, start = self.pending
        self.pending = None
        self._store_chunk(k, v, start, valid, query_states, has_sinks)

    def _abort(self, pending, was_initialized: bool) -> None:
        """Forget the chunk `pending` (k, v, start) that the attention function refused or failed
        to store, so the layer is as it was before `update` (a transform a failed first chunk
        fixed is dropped too)."""
        if pending is None:
            return
        self.pending = None
        self.length = pending[2]
        if not was_initialized and self.is_initialized:
            self.cache.engine.reset_transforms([self.index])

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
        self._check_dims(key_states)
        b, h, t, d = key_states.shape
        self.cache.rows.ensure(b)
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
        self.pending = None

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
