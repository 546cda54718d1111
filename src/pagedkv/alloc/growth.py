"""Appending to a block group: blocks an append needs (new ones, copies of shared partly
filled last blocks), what a sliding window's reclaim frees first, growth of the pool and
compaction. Mixed into `SequenceManager`; plain Python, no torch.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from ..errors import CacheFull, InvalidInput
from .swapstate import RELEASED


class WindowedAppend:
    """Capacity planning and window reclaim of `SequenceManager` (see the module doc)."""

    def _releasable(self, s, length: int) -> range:
        """Table indices `reclaim` would release before appending at `length`."""
        if self.window is None:
            return range(0)
        return range(max(s.dead, self.keep_first),
                     min(self.first_needed(length) // self.block_size, len(s.table)))

    def _need(self, s, n: int, shared: dict) -> int:
        """Blocks an append of n tokens takes (new blocks + a copy of a shared last block).
        shared: counts writers per shared last block in a batch: once all but one holder copied
        it, the last writes in place (so copies = min(writers, ref - 1))."""
        if n == 0:
            return 0
        bs = self.block_size
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

    def demand(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> tuple[int, int]:
        """(blocks an append of `counts` new tokens takes, blocks its window reclaim frees):
        no change. Shared blocks count as freed once every holder lets go."""
        seqs = [self._get(i) for i in seq_ids]
        shared: dict[int, int] = {}
        need = sum(self._need(s, n, shared) for s, n in zip(seqs, counts))
        drops: dict[int, int] = {}
        for s, n in zip(seqs, counts):
            if n:
                for i in self._releasable(s, len(s.tokens)):
                    b = s.table[i]
                    if b >= 0:
                        drops[b] = drops.get(b, 0) + 1
        return need, sum(1 for b, k in drops.items() if self.pool._ref[b] == k)

    def fits(self, need: int, freed: int) -> bool:
        return need - freed <= self.pool.headroom

    def full_error(self, n_tokens: int, n_seqs: int, need: int, freed: int) -> CacheFull:
        what = "global" if self.window is None else f"sliding-window (W={self.window})"
        pool = self.pool
        return CacheFull(
            f"{n_tokens} new tokens over {n_seqs} sequences: the paged cache's {what} layers need "
            f"{need} more blocks of {self.block_size} tokens but have "
            f"{pool.num_available + freed} free of {pool.num_blocks} (the limit allows "
            f"{pool.max_blocks} blocks; raise max_tokens or the cache's capacity)")

    def reclaim(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> None:
        """Release, per sequence about to get new tokens, the blocks wholly before
        `first_needed(length)`: no query at or after its current end can see them."""
        for sid, n in zip(seq_ids, counts):
            s = self._get(sid)
            if n:
                for i in self._releasable(s, len(s.tokens)):
                    self.entries.drop(s.table[i])
                    s.table[i] = RELEASED
                    s.dead = i + 1

    def extend(self, seq_ids: Sequence[Hashable], parsed: Sequence[tuple[int, list[int], bool]]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        """Append already checked tokens (`check_tokens` results; capacity from `demand`):
        reclaim, grow as needed, copy shared last blocks. Returns (slots, copies)."""
        counts = [p[0] for p in parsed]
        need, freed = self.demand(seq_ids, counts)
        self.reclaim(seq_ids, counts)
        if not self.pool.ensure(need):  # pragma: no cover - callers check `fits` first
            raise self.full_error(sum(counts), len(seq_ids), need, freed)
        copies: list[tuple[int, int]] = []
        slots: list[int] = []
        for sid, (n, toks, known) in zip(seq_ids, parsed):
            s = self._seqs[sid]
            start = self._append(s, n, toks, known, copies)
            slots.extend(self._slots(s, start, n))
        return slots, copies

    def compact(self, target: int) -> list[tuple[int, int]]:
        """Cut the pool to `target` blocks, renumbering tables (see `BlockPool.compact`)."""
        moves = self.pool.compact(target)
        if moves:
            m = dict(moves)
            for s in self._seqs.values():
                t = s.table
                for i, b in enumerate(t):
                    if b in m:
                        t[i] = m[b]
        return moves

