"""The shared prefix store: publish full blocks, load a new sequence's prefix block by block.

Key of a block: `StoreKeys.key(layout, chain)` (`keys.py`), a keyed MAC from the operator's
secret over the store identity (model identity, formats, dims, sliding windows), the namespace,
the layout fingerprint (codecs, codebooks, scales, calibration) and the chain hash (the cache's
own prefix key, `pagedkv.alloc.hashing`: every token id up to the block's end and the salt). The
stored value is the record (`record.py`) bound to that key and sealed with a MAC; the chain hash
is never stored. Lookups read at most the expected value size.

An entry that is present but fails its checks (damaged, truncated, forged, another type) is
deleted when found, so the block's next publish replaces it (publishing skips existing keys).

`fetch` reads the blocks the block manager asks for (`pagedkv.alloc.tierload.load_prefix`: per
block group what a prompt's longest hit lacks in memory, which it writes into fresh pool blocks
registered under their chain hash, so the cache's own `add_sequence` then finds them as ordinary
prefix hits); the first miss ends a fetch. Each block group of a cache is its own set of keys
(`group`). Publishing never raises: a tier that is down or full skips the write (the tier warns
once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from ..ops.batch import PagedLayer
from .keys import StoreKeys
from .record import BlockLayout, read_block
from .tiers import Tier, TierWriteError

log = logging.getLogger(__name__)


@dataclass
class PrefixStats:
    lookups: int = 0  # add_sequence calls that consulted the store
    blocks_loaded: int = 0  # blocks read from the store into memory
    blocks_published: int = 0
    publish_failures: int = 0
    bytes_loaded: int = 0
    bytes_published: int = 0
    damaged_removed: int = 0  # entries that failed their checks and were deleted


class PrefixStore:
    """Publishes and loads whole blocks (every layer) through one tier."""

    def __init__(self, tier: Tier, keys: StoreKeys, batch_blocks: int = 8):
        """keys: the store keys and seals (`store.open_prefix_store` builds them from the
        configs). batch_blocks: blocks looked up per round trip on a remote tier
        (`Tier.get_many`); a miss ends the walk, so a larger batch can fetch a few values that
        are not used."""
        self.tier = tier
        self.keys = keys
        self.batch_blocks = batch_blocks
        self.stats = PrefixStats()
        tier.settled.append(self._settled)

    def _settled(self, stored: list) -> None:
        """Publishes counted as failed that the tier later found stored."""
        self.stats.publish_failures -= len(stored)
        self.stats.blocks_published += len(stored)
        self.stats.bytes_published += sum(n for _, n in stored)

    def fetch(self, layout: BlockLayout, chains: Sequence[bytes], group: bytes = b""
              ) -> Iterator[Optional[list[tuple[bytes, bytes]]]]:
        """The stored sections (per layer (K, V) bytes) of the blocks whose chain keys are
        `chains`, in order, None for a miss, after which it stops (the block manager's
        `load_prefix` decides what to ask for: `pagedkv.alloc.tierload`). A remote tier is
        asked `batch_blocks` keys per round trip. Never raises for tier faults."""
        if not chains:
            return
        self.stats.lookups += 1
        ahead = self.batch_blocks if self.tier.remote else 1
        for start in range(0, len(chains), ahead):
            keys = [self.keys.key(layout, c, group) for c in chains[start:start + ahead]]
            vals = self.tier.get_many(keys, size=self.keys.size(layout, keys[0]))
            for j, (key, raw) in enumerate(zip(keys, vals)):
                sections = self.keys.open(raw, layout, key)
                if sections is None:
                    if raw is not None:
                        self._remove_damaged(key, start + j)
                    yield None
                    return
                self.stats.blocks_loaded += 1
                self.stats.bytes_loaded += len(raw)
                yield sections

    def publish_many(self, layers: Sequence[PagedLayer], layout: BlockLayout,
                     blocks: Sequence[tuple[int, bytes]], group: bytes = b"") -> int:
        """Publish several (pool block, chain hash) pairs of one block group (`group`: its tag
        in the store keys): one round trip on a remote tier. Returns how many were stored.
        Never raises for tier faults."""
        if not blocks:
            return 0
        if not self.tier.remote:
            return sum(self.publish(layers, layout, b, c, group) for b, c in blocks)
        recs = []
        for b, c in blocks:
            key = self.keys.key(layout, c, group)
            recs.append((key, self.keys.seal(layout, key, read_block(layers, b))))
        res = self.tier.put_many(recs, if_absent=True)
        for (_, rec), ok in zip(recs, res):
            if ok:
                self.stats.blocks_published += 1
                self.stats.bytes_published += len(rec)
            else:
                self.stats.publish_failures += 1
        return sum(res)

    def publish(self, layers: Sequence[PagedLayer], layout: BlockLayout, block: int,
                chain: bytes, group: bytes = b"") -> bool:
        """Store pool block `block` (prefix key `chain`) unless already stored. Never raises for
        tier faults (returns False)."""
        key = self.keys.key(layout, chain, group)
        rec = self.keys.seal(layout, key, read_block(layers, block))
        try:
            ok = self.tier.put(key, rec, if_absent=True)
        except TierWriteError as exc:
            self.tier._warn_once("write", f"{exc}; prefix blocks are not published "
                                          + ("until it has room" if exc.full else "to it"))
            ok = False
        if ok:
            self.stats.blocks_published += 1
            self.stats.bytes_published += len(rec)
        else:
            self.stats.publish_failures += 1
        return ok

    def _remove_damaged(self, key: str, block: int) -> None:
        """Delete an entry that failed its checks, so that the next publish replaces it."""
        log.warning("prefix store: the entry of block %d (%s in %s) failed its checks; deleted "
                    "it, recomputing from there", block, key, self.tier.name)
        self.tier.delete(key)
        self.stats.damaged_removed += 1
