"""Appending to a block group: blocks an append needs (new ones, copies of shared partly
filled last blocks), what a sliding window's reclaim frees first, growth of the pool and
compaction. An object `SequenceManager` holds (`growth`); its methods take the sequences'
`_Seq` records, which the manager owns. Plain Python, no torch.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..errors import CacheFull, InvalidInput
from .pool import BlockPool
from .shape import GroupShape
from .swapstate import RELEASED, TableEntries


class WindowedAppend:
    """Capacity planning, window reclaim and appends of one block group (see the module doc);
    the pool, the group's shape and the table entries' reference rule are the manager's."""

    def __init__(self, pool: BlockPool, shape: GroupShape, entries: TableEntries):
        self.pool, self.shape, self.entries = pool, shape, entries

    def releasable(self, s, length: int) -> range:
        """Table indices `reclaim` would release before appending at `length`."""
        shape = self.shape
        if shape.window is None:
            return range(0)
        return range(max(s.dead, shape.keep_first),
                     min(shape.first_needed(length) // shape.block_size, len(s.table)))

    def need(self, s, n: int, shared: dict) -> int:
        """Blocks an append of n tokens takes (new blocks + a copy of a shared last block).
        shared: counts writers per shared last block in a batch: once all but one holder copied
        it, the last writes in place (so copies = min(writers, ref - 1))."""
        if n == 0:
            return 0
        bs = self.shape.block_size
        L = len(s.tokens)
        need = -(-(L + n) // bs) - len(s.table)
        if L % bs:
            last = s.table[-1]
            if last < 0:
                raise InvalidInput("the last block of a sequence is not resident")
            r = self.pool._ref[last]
            if r > 1:
                c = shared.get(last, 0)
                if c < r - 1:
                    need += 1
                shared[last] = c + 1
        return need

    def demand(self, seqs: Sequence, counts: Sequence[int]) -> tuple[int, int]:
        """(blocks an append of `counts` new tokens to `seqs` takes, blocks its window reclaim
        frees): no change. Shared blocks count as freed once every holder lets go."""
        shared: dict[int, int] = {}
        need = sum(self.need(s, n, shared) for s, n in zip(seqs, counts))
        drops: dict[int, int] = {}
        for s, n in zip(seqs, counts):
            if n:
                for i in self.releasable(s, len(s.tokens)):
                    b = s.table[i]
                    if b >= 0:
                        drops[b] = drops.get(b, 0) + 1
        return need, sum(1 for b, k in drops.items() if self.pool._ref[b] == k)

    def fits(self, need: int, freed: int) -> bool:
        return need - freed <= self.pool.headroom

    def full_error(self, n_tokens: int, n_seqs: int, need: int, freed: int) -> CacheFull:
        window = self.shape.window
        what = "global" if window is None else f"sliding-window (W={window})"
        pool = self.pool
        return CacheFull(
            f"{n_tokens} new tokens over {n_seqs} sequences: the paged cache's {what} layers need "
            f"{need} more blocks of {self.shape.block_size} tokens but have "
            f"{pool.num_available + freed} free of {pool.num_blocks} (the limit allows "
            f"{pool.max_blocks} blocks; raise max_tokens or the cache's capacity)")

    def reclaim(self, seqs: Sequence, counts: Sequence[int]) -> None:
        """Release, per sequence about to get new tokens, the blocks wholly before
        `first_needed(length)`: no query at or after its current end can see them."""
        for s, n in zip(seqs, counts):
            if n:
                for i in self.releasable(s, len(s.tokens)):
                    self.entries.drop(s.table[i])
                    s.table[i] = RELEASED
                    s.dead = i + 1

    def append(self, s, n: int, toks: list[int], known: bool,
               copies: list[tuple[int, int]]) -> int:
        """Append to `s` (reclaimed, capacity checked); returns the first new position."""
        pool, bs = self.pool, self.shape.block_size
        L = len(s.tokens)
        if n == 0:
            return L
        if L % bs:
            last = s.table[-1]
            if pool._ref[last] > 1:  # shared, partly filled: copy before writing
                new = pool._take()
                copies.append((last, new))
                pool.record_copy(new, last)
                pool.release(last)
                s.table[-1] = new
            elif pool._hash[last] is not None:  # sole owner of a keyed block: drop the key
                pool.unregister(last)
        for _ in range(-(-(L + n) // bs) - len(s.table)):
            s.table.append(pool._take())
        s.tokens.extend(toks)
        self.mark_fill(s, L, L + n)
        if not known and s.first_unknown > L:
            s.first_unknown = L
        return L

    def mark_fill(self, s, start: int, end: int) -> None:
        """Record that positions start..end-1 of `s` have slots (per-block high-water mark)."""
        bs, fill, t = self.shape.block_size, self.pool.fill, s.table
        for j in range(start // bs, (end - 1) // bs + 1):
            f = min(bs, end - j * bs)
            b = t[j]
            if fill[b] < f:
                fill[b] = f

    def extend(self, seqs: Sequence, parsed: Sequence[tuple[int, list[int], bool]]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        """Append already checked tokens (`check_tokens` results; capacity from `demand`):
        reclaim, grow as needed, copy shared last blocks. Returns (slots, copies)."""
        counts = [p[0] for p in parsed]
        need, freed = self.demand(seqs, counts)
        self.reclaim(seqs, counts)
        if not self.pool.ensure(need):  # pragma: no cover - callers check `fits` first
            raise self.full_error(sum(counts), len(seqs), need, freed)
        copies: list[tuple[int, int]] = []
        slots: list[int] = []
        for s, (n, toks, known) in zip(seqs, parsed):
            start = self.append(s, n, toks, known, copies)
            slots.extend(self.shape.slots(s.table, start, n))
        return slots, copies

    def compact(self, seqs: Iterable, target: int) -> list[tuple[int, int]]:
        """Cut the pool to `target` blocks, renumbering the tables of `seqs` (every sequence of
        the group; see `BlockPool.compact`)."""
        moves = self.pool.compact(target)
        if moves:
            m = dict(moves)
            for s in seqs:
                t = s.table
                for i, b in enumerate(t):
                    if b in m:
                        t[i] = m[b]
        return moves
