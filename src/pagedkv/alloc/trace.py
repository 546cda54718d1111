"""Optional per-block event trace: alloc, share, free, cache, evict, copy.

Off by default (the pool keeps `trace = None` and pays one `is not None` test per operation).
Switched on by `CacheConfig(trace=True)`; the CLI may set that default from an environment
variable, nothing below it reads one. Events are kept in a bounded deque (oldest dropped).
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, NamedTuple, Optional


class BlockEvent(NamedTuple):
    """One event. kind: 'alloc' (handed out, ref 1), 'share' (ref + 1, incl. revival of a cached
    block), 'free' (ref - 1; ref 0 means back to the free list or, if hashed, to the LRU),
    'cache' (registered in the prefix index), 'uncache' (dropped from the index), 'evict'
    (cached block reclaimed for new data), 'copy' (copy-on-write: `other` is the source block).
    ref: the block's reference count after the event."""

    seq_no: int
    kind: str
    block: int
    ref: int
    other: Optional[int] = None


class BlockTrace:
    """Bounded record of block events, in order."""

    def __init__(self, max_events: int = 1_000_000):
        self.events: deque[BlockEvent] = deque(maxlen=max_events)
        self._n = 0

    def add(self, kind: str, block: int, ref: int, other: Optional[int] = None) -> None:
        self.events.append(BlockEvent(self._n, kind, block, ref, other))
        self._n += 1

    def for_block(self, block: int) -> list[BlockEvent]:
        """The recorded history of one block."""
        return [e for e in self.events if e.block == block]

    def __iter__(self) -> Iterator[BlockEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def clear(self) -> None:
        self.events.clear()
