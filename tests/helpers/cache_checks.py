"""Invariant checks of the transformers cache's block groups, shared by the integration tests."""

from __future__ import annotations


def check_refcounts(cache) -> None:
    """Every group of a PagedKVCache: released entries (-1) only before a row's first live block,
    each block's reference count equals the number of table entries naming it, and the free list
    holds exactly the unreferenced blocks."""
    for g in cache.groups:
        refs = [0] * g.num_blocks
        for r, table in enumerate(g.tables):
            assert all(b == -1 for b in table[:g.dead[r]]) and all(b >= 0 for b in table[g.dead[r]:])
            for b in table[g.dead[r]:]:
                refs[b] += 1
        assert refs == g.ref
        assert sorted(g.free) == [b for b in range(g.num_blocks) if refs[b] == 0]
