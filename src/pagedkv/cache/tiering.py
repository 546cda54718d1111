"""The offload policies of the engine cache: where `PagedCache` calls the tiers.

`PagedCache(config, offload=OffloadConfig(...))` builds one `CacheTiers` over every block group;
it holds the policies (`pagedkv.offload.coretiers.CoreTiers`: the resident cap with swap, the
shared prefix store; a group's records hold its block id in each of its members: the pages of
its layers and the recent-window tails it holds) and the store's transform record
(`transform_record.SharedTransform`) as objects it calls. The cache calls it at admit (`before_add`: load the prompt's
longest stored hit into the pools as cached prefix blocks, where the admission finds them), at
commit (`after_commit`: publish newly full blocks, then swap each sequence down to the cap in
every group), at attention (`view_of`: a member with swapped blocks read back), at pop (`pop_fetch`: a
swapped block that becomes the partly filled last block is read back before anything changes)
and after entries go (`drop_dead`: delete records no table entry names).

A swapped block is a state of its table entry in `pagedkv.alloc` (a record id with an ordinary
reference count next to the blocks'): fork, pop, free and the invariant check need nothing here.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ..alloc.hashing import Salt, root_hash
from ..compose import calls
from ..errors import ConfigError
from ..ops.batch import PagedLayer
from ..offload.config import OffloadConfig
from ..offload.coretiers import CoreTiers
from ..offload.policy import build_tiers
from .groups import group_tags
from .storage import record_member
from .transform_record import SharedTransform


def _loadable(tokens, salt: Salt) -> Optional[list]:
    """The prompt as a list of valid token ids when a store lookup is worth it, else None (the
    admission then raises its own error)."""
    if isinstance(tokens, (int, str, bytes)):
        return None
    try:  # a tensor / ndarray of ids, as add_sequence accepts
        toks = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    except TypeError:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in toks):
        return None
    try:
        root_hash(b"", salt)
    except TypeError:
        return None
    return toks


class CacheTiers:
    """The policies of one engine cache (see the module doc): it holds `policies` (`CoreTiers`:
    swap and prefix store over every block group) and `transform` (`SharedTransform`: the
    layers' transform as the prefix store's side record) and calls them with the cache's
    members and transforms. Given the parts it reads, never the cache: `storage`
    (`groups.GroupStorage`: the block manager, layers, tails, block groups), `transforms`
    (`transforms.LayerTransforms`) and the `CacheConfig`. swap_tier / prefix_tier: tiers to use
    instead of those `offload` describes (tests, one tier shared by caches)."""

    def __init__(self, storage, transforms, config, offload: OffloadConfig, swap_tier=None,
                 prefix_tier=None):
        if not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload must be an OffloadConfig, got {type(offload).__name__}")
        self.offload = offload
        self.storage, self.transforms = storage, transforms
        # the private swap directory goes with these tiers (close(), or when they are collected)
        swap, prefix, self.close = build_tiers(self, config, offload, swap_tier, prefix_tier,
                                               len(storage.core.groups))
        self.policies = CoreTiers(storage.core, self._members, swap, offload.resident_blocks_per_seq,
                                  prefix, group_tags(storage.layout))
        self.transform = SharedTransform(prefix)
        self.tier_hit_tokens = 0
        self.loaded_blocks = 0  # blocks brought up from the prefix store

    space = property(lambda self: self.policies.space, doc="the swap space (or None)")
    store = property(lambda self: self.policies.store, doc="the prefix store (or None)")
    enforce = calls("policies", CoreTiers.enforce)
    drop_dead = calls("policies", CoreTiers.drop_dead)
    pop_fetch = calls("policies", CoreTiers.pop_fetch)
    pop_restore = calls("policies", CoreTiers.pop_restore)
    stats = calls("policies", CoreTiers.stats)

    def _members(self, g: int) -> list[Optional[PagedLayer]]:
        """Group g's members now, pools sized to its block pool, as records see them (a latent
        layer: `storage.record_member`); None for a layer whose transform the front door has
        still to fit (`fit_first_chunk`: the tiers wait)."""
        st = self.storage
        st.sync_sizes()
        fitted = self.transforms.fitted
        wait = self.transforms.fit_first_chunk and len(fitted) < len(st.layers)
        return [None if wait and i not in fitted else
                record_member(st.layers[i]) if kind == "main" else st.tails[i]
                for kind, i in st.layout.members[g]]

    def _adopt(self) -> None:
        """Adopt the store's transform when this cache fits its own and has fixed none yet: a
        latent cache's fp8 scales, a `fit_first_chunk` cache's K/V transforms."""
        shapes = self.transforms.adoptable_shapes()
        if shapes is not None:
            got = self.transform.stored_transform(shapes)
            if got is not None:
                self.transforms.adopt(got)

    def before_add(self, seqs, tokens, salt: Salt, seq_id: Optional[Hashable]):
        """(tokens to admit, hit blocks in memory before loading). Loaded blocks stay cached
        (evictable) even if the admission then fails for another reason."""
        toks = _loadable(tokens, salt) if self.store is not None else None
        if toks is None:
            return tokens, None
        if seq_id is not None and seq_id in seqs:
            return toks, None
        self._adopt()
        before, loaded = self.policies.load(toks, salt)
        self.loaded_blocks += loaded
        return toks, before

    def after_commit(self, ids: Sequence[Hashable]) -> None:
        """Publish the transform this cache fitted (latent fp8 scales, or with
        `fit_first_chunk` the K/V transforms; once every layer's is fixed), then the blocks
        (`CoreTiers.after_commit`)."""
        if self.store is not None:
            transforms = self.transforms.shared()
            if transforms is not None:
                self.transform.publish_transform(transforms)
        self.policies.after_commit(ids)

    def view_of(self, kind: str, layer: int, g: int, seq_ids: Sequence[Hashable], epoch: int,
                device: torch.device):
        """(member with the batch's swapped blocks of group g read back, tables) or None."""
        if self.space is None:
            return None
        index = self.storage.layout.members[g].index((kind, layer))
        return self.policies.view(g, index, seq_ids, device, epoch)
