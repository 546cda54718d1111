"""Invariant checks of the transformers cache's block groups, shared by the integration tests."""

from __future__ import annotations


def check_refcounts(cache) -> None:
    """Every group of a PagedKVCache: released entries (-1) only before a row's first live block,
    each block's reference count equals the number of table entries naming it, and the free list
    holds exactly the unreferenced blocks (the block manager's invariant check covers all of it,
    every group and pool)."""
    cache.core.check_invariants()
    for g in cache.groups:
        for table, dead in zip(g.tables, g.dead):
            assert all(b == -1 for b in table[:dead]) and all(b >= 0 for b in table[dead:])
