"""The prefix chain of a block group: where chain keys are computed (`chain` for a prompt,
`commit` for sequences' newly full committed blocks, which it keys in the pool; both walk
`hashing.chain`, the one implementation of the chain), what a
hit needs in this group (`hit_blocks`: every leading block without a window; with a sliding
window W only the blocks covering the hit's last W positions and the kept first blocks, as
vLLM's hybrid allocator), the longest hit it holds (`feasible`), what an admission with a hit
costs (`hit_cost`), and what a prefix tier publishes (`newly_full`). An object
`SequenceManager` holds (`keys`); the methods that change a sequence take its `_Seq` record.
Plain Python, no torch.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..errors import ConfigError
from .hashing import Salt, chain, root_hash
from .pool import BlockPool
from .shape import GroupShape


class PrefixChain:
    """Prefix keys of one block group (see the module doc). The one owner of the group's
    `namespace` (bytes mixed into every root key: model identity, format, layer layout, and the
    layers' transform once fitted, so the cache sets it) and of `enabled` (key committed full
    blocks at all)."""

    def __init__(self, pool: BlockPool, shape: GroupShape, namespace: bytes = b"",
                 enabled: bool = True):
        self.pool, self.shape = pool, shape
        self.namespace = namespace
        self.enabled = enabled

    def root(self, salt: Salt = None) -> bytes:
        """The root key of a sequence with `salt` (ConfigError for a salt of a bad type)."""
        try:
            return root_hash(self.namespace, salt)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None

    def chain(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Keys of the full blocks a prompt could hit (always leaving one token to run)."""
        bs = self.shape.block_size
        return chain(self.root(salt), tokens, bs, end_block=(len(tokens) - 1) // bs if tokens else 0)

    def hit_span(self, n: int) -> tuple[int, int]:
        """(keep, lo): a hit of the first n blocks must hold blocks [0, keep) and [lo, n) in this
        group (keep <= lo); every block without a window; with window W the first `keep_first`
        and those from the block of position n*bs - W + 1 on (what a query at position n*bs or
        later can see). Blocks [keep, lo) are released entries of the admitted sequence."""
        shape = self.shape
        if shape.window is None:
            return 0, 0
        keep = min(shape.keep_first, n)
        return keep, max(keep, shape.first_needed(n * shape.block_size) // shape.block_size)

    def hit_blocks(self, n: int) -> list[int]:
        """Table indices a hit of the first n blocks must hold (see `hit_span`)."""
        keep, lo = self.hit_span(n)
        return list(range(keep)) + list(range(lo, n))

    def feasible(self, keys: Sequence[bytes], cap: int) -> int:
        """The most leading blocks (at most cap) of a chain this group can serve as a hit now:
        the pool holds every block `hit_blocks` names (no change)."""
        if not self.enabled:
            return 0
        n = min(cap, len(keys))
        lookup = self.pool.lookup
        if self.shape.window is None:
            for i in range(n):
                if lookup(keys[i]) is None:
                    return i
            return n
        while n:
            miss = [i for i in self.hit_blocks(n) if lookup(keys[i]) is None]
            if not miss:
                break
            n = miss[-1]  # a hit that ends at or before the missing block cannot see it
        return n

    def match(self, tokens: Sequence[int], salt: Salt = None) -> int:
        """Leading full blocks of `tokens` this group alone could serve now (no change)."""
        return self.feasible(self.chain(tokens, salt), len(tokens)) if self.enabled else 0

    def hit_cost(self, keys: Sequence[bytes], n: int, held_blocks: int) -> int:
        """Blocks an admission holding `held_blocks` blocks with a hit of n blocks (feasible)
        takes from the pool's headroom: hit blocks nobody holds (revived from the cache) and
        the blocks after the hit."""
        pool = self.pool
        idle = sum(1 for i in self.hit_blocks(n) if pool.ref_count(pool.lookup(keys[i])) == 0)
        return idle + max(0, held_blocks - n)

    def commit(self, seqs: Iterable) -> None:
        """Mark every allocated token of the sequences (`_Seq` records) as written; key newly
        full blocks."""
        bs, pool = self.shape.block_size, self.pool
        for s in seqs:
            s.committed = len(s.tokens)
            if not self.enabled:
                continue
            full = min(s.committed, s.first_unknown) // bs
            first = len(s.hashes)
            if full <= first:  # no newly full block (most decode steps)
                continue
            new = chain(s.root, s.tokens, bs, s.hashes[-1] if s.hashes else None, first, full)
            s.hashes.extend(new)
            for i, h in enumerate(new, first):
                if s.table[i] >= 0:
                    pool.register(s.table[i], h)

    @staticmethod
    def newly_full(s) -> list[tuple[int, bytes]]:
        """(pool block, chain key) of the committed, keyed blocks of sequence `s` (a `_Seq`) not
        handed out before (for a prefix tier to publish); swapped ones are skipped (published
        before they left), and so are blocks a window released before they were committed."""
        out = [(s.table[i], s.hashes[i]) for i in range(s.published, len(s.hashes))
               if s.table[i] >= 0]
        s.published = len(s.hashes)
        return out
