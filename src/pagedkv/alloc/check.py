"""The invariant check of the block manager: every sequence's table against every pool.

O(total), for tests and debugging: AssertionError naming the first violation. One check covers
what any combination of prefix hits, copy-on-write, window reclaim, growth, compaction and swap
can break: reference counts (blocks and swap records) equal the table entries naming them, each
block is in exactly one of free / cached / used, the mirrors the cache reads agree, and keyed
blocks hold the chain key of the tokens every holder has there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .hashing import chain_hash
from .swapstate import RELEASED, swapped_record

if TYPE_CHECKING:  # the manager calls this check (`check_invariants`): no import back at run time
    from .sequences import SequenceManager


def check_sequences(m: "SequenceManager") -> None:
    """Check one block group (its sequences, records and pool)."""
    pool, bs = m.pool, m.block_size
    refs = [0] * pool.num_blocks
    recs: dict[int, int] = {}
    for sid, s in m._seqs.items():
        assert len(s.table) == -(-len(s.tokens) // bs), f"{sid!r}: table length"
        assert s.committed <= len(s.tokens), f"{sid!r}: committed > length"
        k = min(m.keep_first, s.dead) if s.dead else 0
        assert RELEASED not in s.table[:k], f"{sid!r}: a kept leading block was released"
        assert all(e == RELEASED for e in s.table[k:s.dead]), f"{sid!r}: released entries"
        assert RELEASED not in s.table[s.dead:], f"{sid!r}: a released entry after live ones"
        assert not s.dead or m.window is not None, f"{sid!r}: released entries without a window"
        if s.table:
            assert s.table[-1] >= 0 or len(s.tokens) % bs == 0, f"{sid!r}: last block not resident"
        for e in s.table:
            if e >= 0:
                refs[e] += 1
            elif e <= -2:
                rid = swapped_record(e)
                recs[rid] = recs.get(rid, 0) + 1
                assert (s.table.index(e) + 1) * bs <= s.committed, f"{sid!r}: uncommitted swap"
        h = s.root
        for i in range(len(s.tokens) // bs):
            if i * bs + bs > min(s.committed, s.first_unknown) or not m.prefix:
                break
            h = chain_hash(h, s.tokens[i * bs:(i + 1) * bs])
            if i < len(s.hashes):
                assert s.hashes[i] == h, f"{sid!r}: stale chain key of block {i}"
            if s.table[i] >= 0:
                bh = pool.block_hash(s.table[i])
                assert bh is None or bh == h, f"{sid!r}: block {s.table[i]} keyed for other data"
    assert recs == m.rec_refs, f"swap record references {m.rec_refs} but tables hold {recs}"
    assert set(m.rec_chain) <= set(m.rec_refs), "chain of a dead record"
    free, cached = set(pool._free), set(pool._cached)
    assert len(free) == len(pool._free), "block twice on the free list"
    assert not free & cached, "block both free and cached"
    assert len(pool._ref) == len(pool._hash) == len(pool.in_use) == len(pool.fill) \
        == len(pool.keyed) == pool.num_blocks <= pool.max_blocks, "pool arrays disagree on size"
    for b in range(pool.num_blocks):
        assert pool._ref[b] == refs[b], f"block {b}: ref {pool._ref[b]} but {refs[b]} holders"
        where = (b in free) + (b in cached) + (refs[b] > 0)
        assert where == 1, f"block {b} is in {where} places"
        assert pool.in_use[b] == (refs[b] > 0), f"block {b}: in_use mirror"
        assert pool.keyed[b] == (pool._hash[b] is not None), f"block {b}: keyed mirror"
        if b in free:
            assert pool._hash[b] is None, f"free block {b} has a key"
        if b in cached:
            assert pool._hash[b] is not None, f"cached block {b} has no key"
    for key, b in pool._index.items():
        assert pool._hash[b] == key, f"index entry of block {b} disagrees"
    keyed = sum(1 for h in pool._hash if h is not None)
    assert keyed == len(pool._index), "keyed blocks missing from the index"
    assert pool.num_free + pool.num_cached + pool.num_used == pool.num_blocks
