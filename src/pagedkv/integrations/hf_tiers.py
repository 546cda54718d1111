"""The offload tiers of the transformers drop-in: a per-row resident cap (swap) and a shared
prefix store, through the policies of `pagedkv.offload.policy` on the global block group.

`PagedKVCache(model, fmt, offload=OffloadConfig(...))` builds one `DropInTiers`. The cache calls
it after each commit (publish the newly full blocks, swap rows down to the cap), at attention
(the layer with swapped blocks read back), at `begin` (adopt the store's transform, load the
prompts' stored blocks) and after rows change (delete records no row names).
"""

from __future__ import annotations

import logging
from ..cache.transform_record import decode_transforms, encode_transforms
from ..errors import ConfigError
from ..offload.config import OffloadConfig
from ..offload.policy import PrefixPolicy, SwapPolicy, build_tiers

log = logging.getLogger(__name__)


class DropInTiers:
    def __init__(self, cache, offload: OffloadConfig, swap_tier=None, prefix_tier=None):
        if not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload must be a pagedkv.offload.OffloadConfig, got "
                              f"{type(offload).__name__}")
        self.cache = cache
        if cache.groups[0].window is not None and offload.enabled:
            raise ConfigError("the offload tiers need global (full-attention) layers; every layer "
                              "of this model slides (its cache is bounded by the window already)")
        swap, prefix, self._close = build_tiers(cache, cache.config, offload, swap_tier, prefix_tier)
        self.swap = SwapPolicy(swap, offload.resident_blocks_per_seq) if swap else None
        self.prefix = PrefixPolicy(prefix) if prefix else None
        self._plans: dict = {}
        self.tier_hit_tokens = 0
        self._transform_published = False

    @property
    def seqs(self):
        return self.cache.core.groups[0]

    def layers(self) -> list:
        return [self.cache.layers[i].paged for i in self.cache.groups[0].layers]

    def _ready(self) -> bool:
        return all(p is not None for p in self.layers())

    # ---- commit -------------------------------------------------------------------------------
    def after_commit(self) -> None:
        self._plans = {}
        if not self._ready():
            return
        layers = self.layers()
        if self.prefix is not None and self.cache.core.prefix:
            self._publish_transform()
            for sid in self.cache._rows:
                self.prefix.publish(self.seqs, sid, layers)
        if self.swap is not None:
            for sid in self.cache._rows:
                self.swap.enforce(self.seqs, sid, layers)
            self.cache._tables = {}

    def drop_dead(self) -> None:
        self._plans = {}
        if self.swap is not None:
            self.swap.drop_dead(self.seqs)

    def restore(self, rid: int, block: int) -> None:
        self.swap.restore(self.seqs, rid, block, self.layers())

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, layer, device):
        """(PagedLayer, int32 block tables) layer `layer` attends through: the layer itself and
        the cache's tables, or, when a row has swapped blocks, a view holding them read back."""
        g = layer.group
        if self.swap is None or g.index != 0:
            return layer.paged, self.cache.block_table_tensor(device, g)
        key = str(device)
        if key not in self._plans:
            self._plans[key] = self.swap.plan(self.seqs, self.cache._rows, device)
        plan = self._plans[key]
        if plan is None:
            return layer.paged, self.cache.block_table_tensor(device, g)
        index = g.layers.index(layer.spec.index)
        return self.swap.view(layer.paged, index, self.layers(), plan), plan[2]

    # ---- prefix store -------------------------------------------------------------------------
    def _transform_key(self) -> str:
        return self.prefix.store.keys.aux_key("transform")

    def _publish_transform(self) -> None:
        if self._transform_published:
            return
        layers = [self.cache.layers[i] for i in self.cache.groups[0].layers]
        key = self._transform_key()
        rec = self.prefix.store.keys.seal_bytes(key, encode_transforms([layer.transform() for layer in layers]))
        self._transform_published = True
        try:
            self.prefix.store.tier.put(key, rec, if_absent=True)
        except Exception as exc:  # a tier fault never stops generation
            log.warning("prefix store: the layers' transform was not published (%s)", exc)

    def before_begin(self, rows: list[list[int]]) -> None:
        """Adopt the store's transform when no layer has one yet; load each row's stored blocks
        into the pool (cached), where the admission finds them."""
        if self.prefix is None or not self.cache.core.prefix:
            return
        layers = [self.cache.layers[i] for i in self.cache.groups[0].layers]
        if not any(layer.is_initialized for layer in layers):
            key = self._transform_key()
            raw = self.prefix.store.keys.open_bytes(self.prefix.store.tier.get(key), key)
            got = decode_transforms(raw, [layer.transform_shapes() for layer in layers])
            if got is None:
                return
            for layer, t in zip(layers, got):
                layer.adopt(t)
            self._transform_published = True
        if not self._ready():
            return
        before = self.seqs.pool.num_cached
        for r in rows:
            need = -(-len(r) // self.seqs.block_size)
            self.seqs.pool.ensure(min(need, self.seqs.pool.headroom))
            self.cache._apply_sizes()
            self.prefix.load(self.seqs, self.layers(), r)
        self.loaded_blocks = self.seqs.pool.num_cached - before

    def close(self) -> None:
        self._close()

