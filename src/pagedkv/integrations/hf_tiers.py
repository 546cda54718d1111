"""The offload tiers of the transformers drop-in: a per-row resident cap (swap) and a shared
prefix store in every block group (`pagedkv.offload.coretiers.CoreTiers`: a group's records hold
its block id in the pages of its layers and the recent-window tails it holds).

`PagedKVCache(model, fmt, offload=OffloadConfig(...))` builds one `DropInTiers`. The cache calls
it after each commit (publish the newly full blocks, swap rows down to the cap), at attention
(the layer or its tail with swapped blocks read back), at `begin` (adopt the store's transform,
load the prompts' longest stored hits) and after rows change (delete records no row names).
"""

from __future__ import annotations

from ..cache.groups import group_layout, group_tags
from ..cache.storage import from_record_member, record_member
from ..cache.transform_record import SharedTransform
from ..errors import ConfigError
from ..offload.config import OffloadConfig
from ..offload.coretiers import CoreTiers
from ..offload.policy import build_tiers


class DropInTiers(CoreTiers, SharedTransform):
    def __init__(self, cache, offload: OffloadConfig, swap_tier=None, prefix_tier=None):
        if not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload must be a pagedkv.offload.OffloadConfig, got "
                              f"{type(offload).__name__}")
        self.cache = cache
        swap, prefix, self._close = build_tiers(cache, cache.config, offload, swap_tier, prefix_tier,
                                                len(cache.core.groups))
        super().__init__(cache.core, self._members, swap, offload.resident_blocks_per_seq, prefix,
                         group_tags(group_layout(cache.config)))
        self.tier_hit_tokens = 0
        self.loaded_blocks = 0

    def _members(self, g: int) -> list:
        """Group g's members (None for a layer not built yet), pools sized to its pool."""
        c = self.cache
        view = c.groups[g]
        if any(c.layers[i].paged is not None for i in view.layers):
            c._apply_sizes()
        pages = [c.layers[i].paged for i in view.layers]
        return [None if p is None else record_member(p) for p in pages] + \
            [c.layers[i].tail for i in view.tails]

    # ---- commit -------------------------------------------------------------------------------
    def after_commit(self) -> None:
        if self.prefix is not None and self.ready():
            self.publish_transform([layer.transform() for layer in self.cache.layers])
        super().after_commit(self.cache._rows)
        if self.swap is not None:
            self.cache._tables = {}

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, layer, device, tail: bool = False):
        """(PagedLayer, int32 block tables) layer `layer` (tail=True: its recent-window tail)
        attends through: the layer and the cache's tables, or, when a row has swapped blocks in
        the group, a view holding them read back."""
        c = self.cache
        view = c.tail_group if tail else layer.group
        own = layer.tail if tail else layer.paged
        if self.swap is None:
            return own, c.block_table_tensor(device, view)
        index = (len(view.layers) + view.tails.index(layer.spec.index)) if tail else \
            view.layers.index(layer.spec.index)
        got = self.view(view.index, index, c._rows, device)
        if got is None:
            return own, c.block_table_tensor(device, view)
        return from_record_member(own, got[0]), got[1]  # a latent layer: its pool read back

    # ---- prefix store -------------------------------------------------------------------------
    def before_begin(self, rows: list[list[int]]) -> None:
        """Adopt the store's transform when no layer has one yet; load each row's longest
        stored hit into the pools (cached), where the admission finds it."""
        if self.prefix is None:
            return
        layers = self.cache.layers
        if not any(layer.is_initialized for layer in layers):
            got = self.stored_transform([layer.transform_shapes() for layer in layers])
            if got is None:
                return
            for layer, t in zip(layers, got):
                layer.adopt(t)
        if not self.ready():
            return
        for r in rows:
            self.loaded_blocks += self.load(r)[1]

    def close(self) -> None:
        self._close()
