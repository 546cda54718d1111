"""The shared prefix store: publish full blocks, load a new sequence's prefix block by block.

Key of a block: `StoreKeys.key(layout, chain)` (`keys.py`), a keyed MAC from the operator's
secret over the store identity (model identity, formats, dims, sliding windows), the namespace,
the layout fingerprint (codecs, codebooks, scales, calibration) and the chain hash (the cache's
own prefix key, `pagedkv.alloc.hashing`: every token id up to the block's end and the salt). The
stored value is the record (`record.py`) bound to that key and sealed with a MAC; the chain hash
is never stored. Lookups read at most the expected value size.

An entry that is present but fails its checks (damaged, truncated, forged, another type) is
deleted when found, so the block's next publish replaces it (publishing skips existing keys).

`load` walks a prompt's full blocks in order: a block already in memory is kept; otherwise the
store is asked; the first miss ends the walk (later blocks depend on it). Loaded blocks are written
into fresh pool blocks and registered under their chain hash, so the cache's own `add_sequence`
then finds them as ordinary prefix hits. Publishing never raises: a tier that is down or full
skips the write (the tier warns once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

from ..alloc import BlockPool
from ..alloc.hashing import Salt, chain_hash, root_hash
from ..ops.batch import PagedLayer
from .keys import StoreKeys
from .record import BlockLayout, read_block, write_block
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

    def load(self, pool: BlockPool, layers: Sequence[PagedLayer], layout: BlockLayout,
             namespace: bytes, tokens: Sequence[int], salt: Salt) -> int:
        """Bring the stored leading full blocks of `tokens` into the pool as cached prefix blocks.

        Considers the blocks `SequenceManager.add` would (at least one token is left to run),
        and loads nothing when the admission of `tokens` could not fit anyway (so a CacheFull
        from it still leaves the pool as it was). Returns how many blocks were loaded from the
        store. Never raises for tier faults."""
        bs = layout.block_size
        n = len(tokens)
        nfull = (n - 1) // bs if n else 0
        if nfull == 0:
            return 0
        # in-memory hits first (the cache's own prefix index)
        h = root_hash(namespace, salt)
        hits: list[int] = []
        used_hits = 0
        i = 0
        while i < nfull:
            nh = chain_hash(h, tokens[i * bs:(i + 1) * bs])
            b = pool.lookup(nh)
            if b is None:
                break
            hits.append(b)
            used_hits += pool.ref_count(b) > 0
            h = nh
            i += 1
        if i == nfull or -(-n // bs) - used_hits > pool.num_available:
            return 0  # nothing to load, or the admission will raise CacheFull
        self.stats.lookups += 1
        held: list[int] = []
        loaded = 0
        try:
            for b in hits:  # hold them so that loading cannot evict them
                pool.share(b)
                held.append(b)
            batch: list[tuple[bytes, Optional[bytes]]] = []  # fetched ahead: (chain, value)
            for i in range(i, nfull):
                if not batch:  # one round trip for the next few blocks
                    chains = []
                    ahead = self.batch_blocks if self.tier.remote else 1
                    for j in range(i, min(nfull, i + ahead)):
                        h = chain_hash(h, tokens[j * bs:(j + 1) * bs])
                        chains.append(h)
                    keys = [self.keys.key(layout, c) for c in chains]
                    vals = self.tier.get_many(keys, size=self.keys.size(layout, keys[0]))
                    batch = list(zip(chains, keys, vals))[::-1]
                h_i, key, raw = batch.pop()
                sections = self.keys.open(raw, layout, key)
                if sections is None:
                    if raw is not None:
                        self._remove_damaged(key, i)
                    break
                b = pool.allocate_one()
                write_block(layers, b, sections)
                fill = getattr(pool, "fill", None)
                if fill is not None:
                    fill[b] = bs
                if not pool.register(b, h_i):  # cannot happen (lookup missed); stay safe
                    pool.release(b)
                    break
                held.append(b)
                loaded += 1
                self.stats.bytes_loaded += len(raw)
        finally:
            for b in reversed(held):  # the first block released last: most recently used
                pool.release(b)
        self.stats.blocks_loaded += loaded
        return loaded

    def publish_many(self, layers: Sequence[PagedLayer], layout: BlockLayout,
                     blocks: Sequence[tuple[int, bytes]]) -> int:
        """Publish several (pool block, chain hash) pairs: one round trip on a remote tier.
        Returns how many were stored. Never raises for tier faults."""
        if not blocks:
            return 0
        if not self.tier.remote:
            return sum(self.publish(layers, layout, b, c) for b, c in blocks)
        recs = []
        for b, c in blocks:
            key = self.keys.key(layout, c)
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
                chain: bytes) -> bool:
        """Store pool block `block` (prefix key `chain`) unless already stored. Never raises for
        tier faults (returns False)."""
        key = self.keys.key(layout, chain)
        rec = self.keys.seal(layout, key, read_block(layers, block))
        try:
            ok = self.tier.put(key, rec, if_absent=True)
        except TierWriteError as exc:
            self.tier._warn_once("write", f"{exc}; prefix blocks are not published until it has room")
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
