"""The shape of one block group: its block size, its sliding window and the leading blocks a
window never releases. Frozen, shared by the parts of `SequenceManager` (its prefix chain and
its windowed append read it, nobody changes it); plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class GroupShape:
    """block_size: tokens per block; window: None, or the group's sliding window W; keep_first:
    with a window, the first blocks of every sequence are never released (a recent window's
    tail that also holds the attention sinks)."""

    block_size: int
    window: Optional[int] = None
    keep_first: int = 0

    def first_needed(self, length: int) -> int:
        """The first position a query at any position >= length can see (0 without a window)."""
        return 0 if self.window is None else max(0, length - self.window + 1)

    def slots(self, table, start: int, n: int) -> list[int]:
        """Slots of positions start..start+n-1 of a block table (no check)."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + n)]
