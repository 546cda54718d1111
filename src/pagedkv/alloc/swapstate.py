"""Table-entry states of a block group besides a resident block: released by the window, and
swapped out to a record. A record is counted like a block (references = table entries naming
it; the last one going queues it in `dead_records` for the owner of the tier to delete), so fork,
pop, free and the invariant check treat both states with one rule. Mixed into
`SequenceManager`; plain Python, no torch.
"""

from __future__ import annotations

from itertools import count
from typing import Hashable, Optional, Sequence

RELEASED = -1


def swapped_record(entry: int) -> Optional[int]:
    """The record id of a swapped table entry, None for a resident or released one."""
    return -2 - entry if entry <= -2 else None


class SwapEntries:
    """Reference counting of table entries (blocks and records) and the swap transitions."""

    def _init_records(self) -> None:
        # rid -> references; chain key of a keyed block's record (one record per chain key)
        self.rec_refs: dict[int, int] = {}
        self.rec_chain: dict[int, bytes] = {}
        self._rec_by_chain: dict[bytes, int] = {}
        self._rids = count()
        self.dead_records: list[int] = []  # records whose last reference went: delete them

    def _share_entry(self, e: int) -> None:
        if e >= 0:
            self.pool.share(e)
        elif e <= -2:
            self.rec_refs[-2 - e] += 1

    def _drop_entry(self, e: int) -> None:
        if e >= 0:
            self.pool.release(e)
        elif e <= -2:
            rid = -2 - e
            r = self.rec_refs[rid] - 1
            if r:
                self.rec_refs[rid] = r
            else:
                del self.rec_refs[rid]
                h = self.rec_chain.pop(rid, None)
                if h is not None:
                    del self._rec_by_chain[h]
                self.dead_records.append(rid)

    # ---- swap -------------------------------------------------------------------------------
    def swap_candidates(self, seq_id: Hashable, cap: int) -> list[tuple[int, int, int, bool]]:
        """Entries to swap out so at most `cap` blocks of the sequence stay resident: its oldest
        full committed blocks, never the last. [(index, block, rid, new record)] (no change;
        the caller writes each new record, then calls `swapped_out`). A keyed block already in a
        record (another sequence swapped it) shares that record."""
        s = self._get(seq_id)
        resident = [i for i, b in enumerate(s.table) if b >= 0]
        excess = len(resident) - cap
        full = min(s.committed // self.block_size, len(s.table) - 1)
        out = []
        for i in resident:
            if len(out) >= excess or i >= full:
                break
            b = s.table[i]
            h = self.pool._hash[b]
            rid = self._rec_by_chain.get(h) if h is not None else None
            out.append((i, b, next(self._rids), True) if rid is None else (i, b, rid, False))
        return out

    def swapped_out(self, seq_id: Hashable, done: Sequence[tuple[int, int, int, bool]]) -> None:
        """The records of `done` (from `swap_candidates`) are written: swap the entries."""
        s = self._get(seq_id)
        for i, b, rid, new in done:
            assert s.table[i] == b
            h = self.pool._hash[b]
            if new:
                self.rec_refs[rid] = 1
                if h is not None and h not in self._rec_by_chain:
                    self._rec_by_chain[h] = rid
                    self.rec_chain[rid] = h
            else:
                self.rec_refs[rid] += 1
            self.pool.release(b)
            s.table[i] = -2 - rid

    def swapped(self, seq_id: Hashable) -> list[int]:
        """Logical indices of the sequence's swapped-out blocks."""
        return [i for i, b in enumerate(self._get(seq_id).table) if b <= -2]

    def drain_dead_records(self) -> list[int]:
        out, self.dead_records = self.dead_records, []
        return out

