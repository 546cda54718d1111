"""Table-entry states of a block group besides a resident block: released by the window, and
swapped out to a record. A record is counted like a block (references = table entries naming
it; the last one going queues it in `TableEntries.dead` for the owner of the tier to delete), so fork,
pop, free and the invariant check treat both states with one rule (`TableEntries`, held by
`SequenceManager` as `entries`); plain Python, no torch.
"""

from __future__ import annotations

from itertools import count
from typing import Optional, Sequence

RELEASED = -1


def swapped_record(entry: int) -> Optional[int]:
    """The record id of a swapped table entry, None for a resident or released one."""
    return -2 - entry if entry <= -2 else None


class TableEntries:
    """The one reference rule of a block group's table entries (see the module doc): a resident
    entry is a pool block counted in `pool`, a swapped one a record counted here. The one owner
    of the records' state: `refs` (rid -> references), `chain` (rid -> chain key of a keyed
    block's record; one record per chain key) and `dead` (records whose last reference went, for
    the owner of the tier to delete). The swap transitions take the sequence (`_Seq`) whose
    table they change."""

    def __init__(self, pool):
        self.pool = pool
        self.refs: dict[int, int] = {}
        self.chain: dict[int, bytes] = {}
        self._by_chain: dict[bytes, int] = {}
        self._rids = count()
        self.dead: list[int] = []

    def share(self, e: int) -> None:
        """One more table entry names `e`."""
        if e >= 0:
            self.pool.share(e)
        elif e <= -2:
            self.refs[-2 - e] += 1

    def drop(self, e: int) -> None:
        """A table entry naming `e` went."""
        if e >= 0:
            self.pool.release(e)
        elif e <= -2:
            rid = -2 - e
            r = self.refs[rid] - 1
            if r:
                self.refs[rid] = r
            else:
                del self.refs[rid]
                h = self.chain.pop(rid, None)
                if h is not None:
                    del self._by_chain[h]
                self.dead.append(rid)

    def clear(self) -> None:
        """Every record dead (the group dropped every sequence)."""
        self.dead.extend(self.refs)
        self.refs.clear()
        self.chain.clear()
        self._by_chain.clear()

    def drain(self) -> list[int]:
        """The dead records, handed over once."""
        out, self.dead = self.dead, []
        return out

    # ---- swap -------------------------------------------------------------------------------
    def candidates(self, s, cap: int, block_size: int) -> list[tuple[int, int, int, bool]]:
        """Entries of sequence `s` to swap out so at most `cap` of its blocks stay resident: its
        oldest full committed blocks, never the last. [(index, block, rid, new record)] (no
        change; the caller writes each new record, then calls `swapped_out`). A keyed block
        already in a record (another sequence swapped it) shares that record."""
        resident = [i for i, b in enumerate(s.table) if b >= 0]
        excess = len(resident) - cap
        full = min(s.committed // block_size, len(s.table) - 1)
        out = []
        for i in resident:
            if len(out) >= excess or i >= full:
                break
            b = s.table[i]
            h = self.pool._hash[b]
            rid = self._by_chain.get(h) if h is not None else None
            out.append((i, b, next(self._rids), True) if rid is None else (i, b, rid, False))
        return out

    def swapped_out(self, s, done: Sequence[tuple[int, int, int, bool]]) -> None:
        """The records of `done` (from `candidates`) are written: swap sequence `s`'s entries."""
        for i, b, rid, new in done:
            assert s.table[i] == b
            h = self.pool._hash[b]
            if new:
                self.refs[rid] = 1
                if h is not None and h not in self._by_chain:
                    self._by_chain[h] = rid
                    self.chain[rid] = h
            else:
                self.refs[rid] += 1
            self.pool.release(b)
            s.table[i] = -2 - rid
