"""The prefix chain of a block group: where chain keys are computed (`chain` for a prompt,
`commit` for a sequence's newly full committed blocks, which it keys in the pool; both walk
`hashing.chain`, the one implementation of the chain), what a
hit needs in this group (`hit_blocks`: every leading block without a window; with a sliding
window W only the blocks covering the hit's last W positions and the kept first blocks, as
vLLM's hybrid allocator), the longest hit it holds (`feasible`), what an admission with a hit
costs (`hit_cost`), and what a prefix tier publishes (`newly_full`). Mixed into
`SequenceManager`; plain Python, no torch.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence, Union

from ..errors import ConfigError
from .hashing import Salt, chain, root_hash


class PrefixChain:
    """Prefix keys of `SequenceManager` (see the module doc)."""

    def chain(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """Keys of the full blocks a prompt could hit (always leaving one token to run)."""
        try:
            root = root_hash(self.namespace, salt)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        bs = self.block_size
        return chain(root, tokens, bs, end_block=(len(tokens) - 1) // bs if tokens else 0)

    def hit_span(self, n: int) -> tuple[int, int]:
        """(keep, lo): a hit of the first n blocks must hold blocks [0, keep) and [lo, n) in this
        group (keep <= lo); every block without a window; with window W the first `keep_first`
        and those from the block of position n*bs - W + 1 on (what a query at position n*bs or
        later can see). Blocks [keep, lo) are released entries of the admitted sequence."""
        if self.window is None:
            return 0, 0
        keep = min(self.keep_first, n)
        return keep, max(keep, self.first_needed(n * self.block_size) // self.block_size)

    def hit_blocks(self, n: int) -> list[int]:
        """Table indices a hit of the first n blocks must hold (see `hit_span`)."""
        keep, lo = self.hit_span(n)
        return list(range(keep)) + list(range(lo, n))

    def feasible(self, keys: Sequence[bytes], cap: int) -> int:
        """The most leading blocks (at most cap) of a chain this group can serve as a hit now:
        the pool holds every block `hit_blocks` names (no change)."""
        if not self.prefix:
            return 0
        n = min(cap, len(keys))
        lookup = self.pool.lookup
        if self.window is None:
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
        return self.feasible(self.chain(tokens, salt), len(tokens)) if self.prefix else 0

    def hit_cost(self, keys: Sequence[bytes], n: int, held_blocks: int) -> int:
        """Blocks an admission holding `held_blocks` blocks with a hit of n blocks (feasible)
        takes from the pool's headroom: hit blocks nobody holds (revived from the cache) and
        the blocks after the hit."""
        pool = self.pool
        idle = sum(1 for i in self.hit_blocks(n) if pool.ref_count(pool.lookup(keys[i])) == 0)
        return idle + max(0, held_blocks - n)

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Mark every allocated token of the sequences as written; key newly full blocks."""
        if isinstance(seq_ids, (list, tuple, set, frozenset)) and seq_ids not in self:
            ids = list(seq_ids)
        else:
            ids = [seq_ids]
        seqs = [self._get(i) for i in ids]
        bs, pool = self.block_size, self.pool
        for s in seqs:
            s.committed = len(s.tokens)
            if not self.prefix:
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

    def newly_full(self, seq_id: Hashable) -> list[tuple[int, bytes]]:
        """(pool block, chain key) of the committed, keyed blocks not handed out before (for a
        prefix tier to publish); swapped ones are skipped (published before they left), and so
        are blocks a window released before they were committed."""
        s = self._get(seq_id)
        out = [(s.table[i], s.hashes[i]) for i in range(s.published, len(s.hashes))
               if s.table[i] >= 0]
        s.published = len(s.hashes)
        return out
