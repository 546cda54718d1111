"""Bringing a prompt's prefix up from a tier below memory, for every block group at once.

A prefix hit needs, in every group, the blocks `SequenceManager.hit_blocks` names (all leading
blocks in the global group, the window's last blocks and the kept first ones in a sliding group).
`load_prefix` finds the longest hit memory and the tier can serve together: it holds what memory
has, asks the tier for what is missing (the global group in order, up to its first miss; a
sliding group for its window's blocks, a miss shortening the hit to end before the missing block,
as vLLM's hybrid allocator does), writes what came into fresh pool blocks, keyed and cached
(unreferenced, evictable), and stops when every group agrees. The admission that follows then
finds the hit in memory. Plain Python, no torch: the tier and the data plane are callbacks.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

from .hashing import Salt

Fetch = Callable[[int, list], Iterable[Optional[object]]]
Write = Callable[[int, int, object], None]


def load_prefix(manager, tokens: Sequence[int], salt: Salt, fetch: Fetch, write: Write
                ) -> tuple[int, int]:
    """Fill the pools of `manager` (a `BlockManager`) from a tier so that `add(tokens, salt)`
    then finds the longest hit. fetch(g, chain keys) yields the tier's payload of each key of
    group g in order (None = a miss; the caller may stop early after one); write(g, block,
    payload) stores a payload's bytes in pool block `block` of group g (its pools sized to the
    group's pool first). Nothing is loaded when the admission of `tokens` would not fit even
    with today's hit (so its CacheFull leaves every pool as it was): an admission's cost only
    falls as its hit grows. Returns (the hit in memory before, in blocks; blocks loaded)."""
    keys = manager.chain(tokens, salt)
    before = manager.feasible(keys, len(keys))
    held = -(-len(tokens) // manager.block_size)
    groups = manager.groups
    if before == len(keys) or any(g.hit_cost(keys, before, held) > g.pool.headroom
                                  for g in groups):
        return before, 0
    holds: list[set] = [set() for _ in groups]
    loaded = 0
    n = len(keys)
    try:
        while True:
            m = n
            for gi, g in enumerate(groups):
                got, m = _fill_group(g, gi, keys, m, holds[gi], fetch, write)
                loaded += got
            if m == n:
                return before, loaded
            n = m
    finally:
        for g, held_blocks in zip(groups, holds):
            for b in held_blocks:  # cached again (keyed): the admission revives them
                g.pool.release(b)


def _fill_group(g, gi: int, keys: list, n: int, holds: set, fetch: Fetch, write: Write
                ) -> tuple[int, int]:
    """(blocks loaded, the hit length group g can serve: n or shorter). The global group asks
    for its missing blocks in order and stops at the first miss (the hit ends there); a sliding
    group asks from the last block down and stops at the first miss (a hit ending at or before
    it does not see it; the blocks before it are asked again if the shorter hit's window needs
    them)."""
    pool = g.pool
    missing = []
    for i in g.hit_blocks(n):
        b = pool.lookup(keys[i])
        if b is None:
            missing.append(i)
        elif b not in holds:  # hold it: loading must not evict it
            pool.share(b)
            holds.add(b)
    if g.window is not None:
        missing.reverse()
    if not missing:
        return 0, n
    loaded = 0
    got = iter(fetch(gi, [keys[i] for i in missing]))
    for i in missing:
        payload = next(got, None)
        if payload is None or not pool.ensure(1):
            return loaded, i
        b = pool.allocate_one()
        write(gi, b, payload)
        pool.fill[b] = g.block_size
        pool.register(b, keys[i])
        holds.add(b)
        loaded += 1
    return loaded, n
