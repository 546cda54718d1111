"""The offload policies of the engine cache: where `PagedCache` calls the tiers.

`PagedCache(config, offload=OffloadConfig(...))` builds one `CacheTiers` over its block group
(`pagedkv.offload.policy`: the resident cap with swap, the shared prefix store). The cache calls
it at admit (`before_add`: load the prompt's stored blocks into the pool as cached prefix blocks,
where the admission finds them), at commit (`after_commit`: publish newly full blocks, then swap
each sequence down to the cap), at attention (`view`: the layer with swapped blocks read back),
at pop (`fetch`: a swapped block that becomes the partly filled last block is read back before
anything changes) and after entries go (`drop_dead`: delete records no table entry names).

A swapped block is a state of its table entry in `pagedkv.alloc` (a record id with an ordinary
reference count next to the blocks'): fork, pop, free and the invariant check need nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Optional, Sequence

import torch

from ..alloc.hashing import Salt, root_hash
from ..errors import ConfigError
from ..ops.batch import PagedLayer
from ..offload.config import OffloadConfig
from ..offload.policy import PrefixPolicy, SwapPolicy, build_tiers
from ..offload.record import write_block


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
    """The policies of one engine cache (see the module doc). swap_tier / prefix_tier: tiers to
    use instead of those `offload` describes (tests, one tier shared by caches)."""

    def __init__(self, cache, offload: OffloadConfig, swap_tier=None, prefix_tier=None):
        if not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload must be an OffloadConfig, got {type(offload).__name__}")
        self.offload = offload
        swap, prefix, self.close = build_tiers(cache, cache.config, offload, swap_tier, prefix_tier)
        self.swap = SwapPolicy(swap, offload.resident_blocks_per_seq) if swap is not None else None
        self.prefix = PrefixPolicy(prefix) if prefix is not None else None
        self.tier_hit_tokens = 0
        self._plan: Optional[tuple] = None  # ((epoch, seq ids, device), plan)

    def before_add(self, seqs, layers: Sequence[PagedLayer], tokens, salt: Salt,
                   seq_id: Optional[Hashable]):
        """(tokens to admit, blocks loaded from the prefix store). Loaded blocks stay cached
        (evictable) even if the admission then fails."""
        if self.prefix is None:
            return tokens, 0
        toks = _loadable(tokens, salt)
        if toks is None:
            return tokens, 0
        if seq_id is not None and seq_id in seqs:
            return toks, 0
        return toks, self.prefix.load(seqs, layers, toks, salt)

    def after_commit(self, seqs, ids: Sequence[Hashable], layers: Sequence[PagedLayer]) -> None:
        """Publish newly full blocks (never raises), then enforce the resident cap
        (TierWriteError leaves the commit done and the blocks resident: commit again retries)."""
        self._plan = None
        if self.prefix is not None:
            for sid in ids:
                self.prefix.publish(seqs, sid, layers)
        if self.swap is not None:
            for sid in ids:
                self.swap.enforce(seqs, sid, layers)

    def enforce(self, seqs, seq_id: Hashable, layers: Sequence[PagedLayer]) -> int:
        self._plan = None
        return 0 if self.swap is None else self.swap.enforce(seqs, seq_id, layers)

    def drop_dead(self, seqs) -> None:
        self._plan = None
        if self.swap is not None:
            self.swap.drop_dead(seqs)

    def fetch(self, seqs, rid: int, layers: Sequence[PagedLayer]):
        return self.swap.fetch(seqs, rid, layers)  # type: ignore[union-attr]

    @staticmethod
    def write_back(layers: Sequence[PagedLayer], block: int, sections) -> None:
        write_block(layers, block, sections)

    def view(self, seqs, layers: Sequence[PagedLayer], index: int, seq_ids: Sequence[Hashable],
             epoch: int, device: torch.device) -> Optional[tuple[PagedLayer, torch.Tensor]]:
        """(layer with the batch's swapped blocks read back, its block tables int32 [B, width])
        or None when none of `seq_ids` has a swapped block. The plan is kept while nothing
        changes (`epoch`), so the layers of one step share it."""
        if self.swap is None:
            return None
        key = (epoch, tuple(seq_ids), str(device))
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, self.swap.plan(seqs, seq_ids, device))
        plan = self._plan[1]
        if plan is None:
            return None
        return self.swap.view(layers[index], index, layers, plan, seqs), plan[2]

    def stats(self, seqs) -> dict:
        """Counters of the tiers: swap (outs, ins, bytes, read time) and prefix store."""
        out: dict = {"tier_hit_tokens": self.tier_hit_tokens,
                     "swapped_blocks": sum(len(seqs.swapped(s)) for s in seqs.ids())}
        if self.swap is not None:
            out["swap"] = dataclasses.asdict(self.swap.swap.stats)
            out["swap_tier"] = self.swap.swap.tier.stats.snapshot()
        if self.prefix is not None:
            out["prefix"] = dataclasses.asdict(self.prefix.store.stats)
            out["prefix_tier"] = self.prefix.store.tier.stats.snapshot()
        return out
