"""The offload tiers of a whole block manager: the resident cap and the prefix store in every
block group, for the front doors that own their blocks (the engine cache, the transformers
drop-in).

A group's swap record and a group's stored prefix block hold that group's block id in every
member the group has (the pages of its layers, and the recent-window tails it holds), so a
sliding group only ever swaps or publishes blocks of its window, and a prefix hit loads, per
group, only what `SequenceManager.hit_blocks` names (`pagedkv.alloc.tierload`). `members(g)`,
given by the front door, is group g's layers as the ops see them (pools sized to the group's
pool, or None for a layer not built yet: then the tiers wait).

Calls: `after_commit` (publish newly full blocks of every group, then swap every group down to
the cap), `load` (before an admission), `view` (attention over a group with swapped blocks
read back), `pop_fetch` / `pop_restore` (a pop whose new last block was swapped: read back
before anything changes, written after), `drop_dead` (delete records no entry names).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional, Sequence

from ..alloc.hashing import Salt
from ..alloc.manager import BlockManager
from ..ops.batch import PagedLayer
from .policy import PrefixPolicy, SwapPolicy
from .prefix import PrefixStore
from .record import write_block
from .swap import SwapSpace

Members = Callable[[int], Sequence[Optional[PagedLayer]]]


class CoreTiers:
    """Swap and prefix policies of every group of `core` (see the module doc). tags[g]: group
    g's name in the prefix store's keys (b"" for the global group)."""

    def __init__(self, core: BlockManager, members: Members, swap: Optional[SwapSpace],
                 cap: Optional[int], prefix: Optional[PrefixStore], tags: Sequence[bytes]):
        n = len(core.groups)
        self.core, self.members = core, members
        self.space, self.store = swap, prefix
        self.swap = [SwapPolicy(swap, cap, g) for g in range(n)] if swap is not None else None
        self.prefix = [PrefixPolicy(prefix, tags[g]) for g in range(n)] if prefix is not None \
            else None
        self._plans: dict = {}

    def ready(self) -> bool:
        return all(pl is not None for g in range(len(self.core.groups)) for pl in self.members(g))

    def after_commit(self, ids: Sequence[Hashable]) -> None:
        """Publish newly full blocks (never raises), then enforce the resident cap in every
        group (TierWriteError leaves the commit done and the blocks resident)."""
        self._plans = {}
        if not self.ready():
            return
        groups = self.core.groups
        if self.prefix is not None:
            for g, pol in enumerate(self.prefix):
                layers = self.members(g)
                for sid in ids:
                    pol.publish(groups[g], sid, layers)
        if self.swap is not None:
            for g, pol in enumerate(self.swap):
                layers = self.members(g)
                for sid in ids:
                    pol.enforce(groups[g], sid, layers)

    def enforce(self, seq_id: Hashable) -> int:
        self._plans = {}
        if self.swap is None or not self.ready():
            return 0
        return sum(pol.enforce(self.core.groups[g], seq_id, self.members(g))
                   for g, pol in enumerate(self.swap))

    def load(self, tokens: Sequence[int], salt: Salt = None) -> tuple[int, int]:
        """Bring the prompt's longest hit up from the prefix store into every group's pool
        (cached blocks): (hit blocks in memory before, blocks loaded)."""
        if self.prefix is None or not self.ready():
            return 0, 0

        def fetch(g, chains):
            return self.prefix[g].fetch(self.members(g), chains)

        def write(g, block, sections):
            write_block(self.members(g), block, sections)

        return self.core.load_prefix(tokens, salt, fetch, write)

    def drop_dead(self) -> None:
        self._plans = {}
        if self.swap is not None:
            for g, pol in enumerate(self.swap):
                pol.drop_dead(self.core.groups[g])

    def pop_fetch(self, rids: Sequence[Optional[int]]) -> list:
        """Per group the sections of the record a pop must read back (None where none): read
        before the pop changes anything (SwapLost first)."""
        return [None if rid is None else self.swap[g].fetch(self.core.groups[g], rid,
                                                            self.members(g))
                for g, rid in enumerate(rids)]

    def pop_restore(self, backs: Sequence[Optional[int]], sections: Sequence) -> None:
        """Write what `pop_fetch` read into the pool blocks the pop brought back."""
        for g, (b, sec) in enumerate(zip(backs, sections)):
            if b is not None:
                write_block(self.members(g), b, sec)

    def view(self, g: int, index: int, seq_ids: Sequence[Hashable], device, epoch=None
             ) -> Optional[tuple[PagedLayer, object]]:
        """(member `index` of group g with the batch's swapped blocks read back, its block
        tables int32 [B, width]) or None when none of `seq_ids` has a swapped block in g. The
        plan is kept while nothing changes (`epoch`; every call without one after a change)."""
        if self.swap is None:
            return None
        key = (g, epoch, tuple(seq_ids), str(device))
        plan = self._plans.get(key)
        if key not in self._plans:
            if len(self._plans) > 64:
                self._plans = {}
            plan = self._plans[key] = self.swap[g].plan(self.core.groups[g], seq_ids, device)
        if plan is None:
            return None
        layers = self.members(g)
        return self.swap[g].view(layers[index], index, layers, plan, self.core.groups[g]), plan[2]

    def swapped_blocks(self, seq_ids: Sequence[Hashable]) -> int:
        return sum(len(g.swapped(s)) for g in self.core.groups for s in seq_ids)

    def stats(self, seq_ids: Sequence[Hashable]) -> dict:
        """Counters: swapped blocks now (every group), swap (outs, ins, bytes, read time) and
        the prefix store."""
        out: dict = {"swapped_blocks": self.swapped_blocks(seq_ids)}
        if self.space is not None:
            out["swap"] = dataclasses.asdict(self.space.stats)
            out["swap_tier"] = self.space.tier.stats.snapshot()
        if self.store is not None:
            out["prefix"] = dataclasses.asdict(self.store.stats)
            out["prefix_tier"] = self.store.tier.stats.snapshot()
        return out
