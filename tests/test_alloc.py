"""Block pool and sequence bookkeeping (no tensors): ordering, LRU, keys, failures, through the
block manager's own API (`BlockManager`: add / step / commit / fork / pop / free)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedkv.alloc import BlockPool, chain_hash, root_hash
from pagedkv.alloc.hashing import chain
from pagedkv.alloc.manager import BlockManager, GroupSpec
from pagedkv.errors import CacheFull, ConfigError, UnknownSequence


def test_pool_hands_out_low_ids_first_and_counts():
    p = BlockPool(4)
    assert p.allocate(2) == [0, 1]
    assert (p.num_free, p.num_used, p.num_cached) == (2, 2, 0)
    p.release(1)
    assert p.allocate_one() == 1  # LIFO free list
    with pytest.raises(CacheFull):
        p.allocate(3)
    assert (p.num_free, p.num_used) == (2, 2)  # unchanged by the failed call


def test_pool_lru_keeps_keyed_blocks_until_memory_is_needed():
    p = BlockPool(3, trace=True)
    a, b, c = p.allocate(3)
    assert p.register(a, b"ka") and p.register(b, b"kb")
    assert not p.register(c, b"ka")  # key taken: c stays unkeyed
    for x in (b, a, c):
        p.release(x)
    assert p.cached_blocks() == [b, a] and p.free_blocks() == [c]
    assert p.lookup(b"ka") == a
    p.share(a)  # revive out of the LRU
    assert p.cached_blocks() == [b] and p.ref_count(a) == 1
    p.release(a)  # a is now the most recently used
    assert p.allocate(2) == [c, b]  # free list first, then the LRU head (b)
    assert p.lookup(b"kb") is None and p.lookup(b"ka") == a
    assert p.evictions == 1
    kinds = [e.kind for e in p.trace.for_block(b)]
    assert kinds == ["alloc", "cache", "free", "evict", "alloc"]


def test_reset_prefix_cache_frees_cached_blocks_and_forgets_keys():
    p = BlockPool(3)
    a, b = p.allocate(2)
    p.register(a, b"x")
    p.register(b, b"y")
    p.release(a)
    assert p.reset_prefix_cache() == 1
    assert p.num_cached == 0 and p.index_size() == 0 and p.block_hash(b) is None
    assert p.num_free == 2 and p.num_used == 1


def test_hash_chain_is_deterministic_across_processes_and_salted():
    r = root_hash(b"ns", "tenant")
    assert r != root_hash(b"ns", None) and r != root_hash(b"ns2", "tenant")
    assert root_hash(b"ns", "1") != root_hash(b"ns", 1)
    h = chain_hash(r, [1, 2, 3, 4])
    assert chain_hash(r, [1, 2, 3, 5]) != h and chain_hash(root_hash(b"ns"), [1, 2, 3, 4]) != h
    code = ("from pagedkv.alloc import chain_hash, root_hash;"
            "print(chain_hash(root_hash(b'ns', 'tenant'), [1, 2, 3, 4]).hex())")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={"PYTHONHASHSEED": seed}, check=True).stdout.strip()
        assert out == h.hex()
    assert chain(r, list(range(9)), 4) == [chain_hash(r, [0, 1, 2, 3]),
                                           chain_hash(chain_hash(r, [0, 1, 2, 3]), [4, 5, 6, 7])]


def _mgr(n=8, bs=4):
    return BlockManager([GroupSpec(None, n)], bs, b"test")


def _add(m, tokens, seq_id=None):
    """(seq id, hit tokens, slots) of an admission (one group)."""
    sid, hit, slots = m.add(seq_id, tokens)
    return sid, hit, list(slots[0])


def _append(m, sids, tokens):
    """(slots, copies) of a step appending tokens[i] to sids[i] (one group)."""
    g = m.step(sids, tokens).groups[0]
    return list(g.slots), list(g.copies)


def test_add_commit_then_hit_whole_blocks_only():
    m = _mgr()
    a, hit, slots = _add(m, list(range(10)))
    assert hit == 0 and slots == list(range(10))
    # not committed yet: nothing is keyed, a second prompt must not hit unwritten data
    b, hit, _ = _add(m, list(range(10)))
    assert hit == 0
    m.commit([a, b])
    c, hit, slots = _add(m, list(range(9)) + [99])
    assert hit == 8 and m.main.table(c)[:2] == m.main.table(a)[:2] and len(slots) == 2
    # a prompt fully covered by cached blocks still leaves its last block to compute
    d, hit, _ = _add(m, list(range(8)))
    assert hit == 4
    m.check_invariants()


def test_allocate_by_count_is_never_keyed():
    m = _mgr()
    a, _, _ = _add(m, [1, 2])
    _append(m, [a], [6])  # ids unknown
    m.commit([a])
    assert m.main.pool.index_size() == 0
    b, hit, _ = _add(m, [1, 2, -0, 0, 0, 0, 7])
    assert hit == 0
    m.check_invariants()


def test_fork_then_write_copies_the_shared_partial_block_once():
    m = _mgr()
    t = m.main.table
    a, _, _ = _add(m, [1, 2, 3, 4, 5, 6])
    m.commit([a])
    b = m.fork(a)
    assert m.main.pool.ref_count(t(a)[1]) == 2
    slots, copies = _append(m, [b], [[7]])
    src, dst = copies[0]
    assert copies == [(t(a)[1], t(b)[1])] and src != dst
    assert slots == [dst * 4 + 2]
    slots, copies = _append(m, [a], [[8]])  # now sole owner: in place
    assert copies == [] and slots == [src * 4 + 2]
    m.check_invariants()


def test_pop_then_write_into_a_keyed_block():
    m = _mgr()
    pool, t = m.main.pool, m.main.table
    a, _, _ = _add(m, [1, 2, 3, 4, 5])
    m.commit([a])
    blk = t(a)[0]
    assert pool.block_hash(blk) is not None
    m.pop(a, 2)  # back into the keyed block
    _, copies = _append(m, [a], [[9]])  # sole owner: key dropped, written in place
    assert copies == [] and pool.block_hash(blk) is None
    m.commit([a])
    assert pool.block_hash(blk) == chain_hash(root_hash(b"test"), [1, 2, 3, 9])
    b, _, _ = _add(m, [1, 2, 3, 4, 5])
    m.commit([b])
    c = m.fork(b)
    m.pop(c, 2)
    _, copies = _append(m, [c], [[7]])  # shared keyed block: copied, original keeps its key
    assert len(copies) == 1 and pool.block_hash(t(b)[0]) is not None
    m.check_invariants()


def test_pop_frees_trailing_blocks_and_bad_counts_are_rejected():
    m = _mgr()
    a, _, _ = _add(m, list(range(9)))
    assert m.main.pool.num_used == 3
    m.pop(a, 5)
    assert m.length(a) == 4 and m.main.pool.num_used == 1
    with pytest.raises(ConfigError):
        m.pop(a, 5)
    with pytest.raises(ConfigError):
        m.pop(a, -1)
    assert m.length(a) == 4
    m.pop(a, m.length(a))  # every token: always allowed
    assert m.length(a) == 0 and m.main.pool.num_used == 0


def test_failures_change_nothing():
    m = _mgr(n=4)
    a, _, _ = _add(m, list(range(12)))  # 3 blocks
    m.commit([a])
    b = m.fork(a)
    g = m.main
    before = (g.tokens(a), list(g.table(a)), g.pool.num_free, g.pool.num_used)
    with pytest.raises(CacheFull):
        _add(m, list(range(20, 28)))  # needs 2 new blocks, 1 free
    with pytest.raises(CacheFull):
        _append(m, [a, b], [[1], [2]])  # 2 new blocks needed
    with pytest.raises(UnknownSequence):
        _append(m, [123], [[1]])
    with pytest.raises(UnknownSequence):
        _append(m, [a, 123], [[1], [1]])
    with pytest.raises(ConfigError):
        _append(m, [a, a], [[1], [1]])
    with pytest.raises(ConfigError):
        _append(m, [a], [[1, -2]])
    with pytest.raises(ConfigError):
        _add(m, [1], seq_id=a)
    assert (g.tokens(a), list(g.table(a)), g.pool.num_free, g.pool.num_used) == before
    assert g.tokens(b) == g.tokens(a)
    m.check_invariants()


def test_free_puts_tail_blocks_first_in_line_for_eviction():
    m = _mgr(n=4)
    pool = m.main.pool
    a, _, _ = _add(m, list(range(13)))  # 4 blocks, 3 full
    m.commit([a])
    t = list(m.main.table(a))
    m.free(a)
    assert pool.cached_blocks() == [t[2], t[1], t[0]]
    _add(m, [50, 51])  # takes the free block (t[3]); no eviction
    c, _, _ = _add(m, [60, 61, 62, 63, 64])  # needs 2: evicts t[2] then t[1]
    assert pool.evictions == 2 and pool.cached_blocks() == [t[0]]
    m.free(c)  # never committed: its blocks go straight to the free list
    assert pool.num_free == 2 and pool.num_cached == 1
    d, hit, _ = _add(m, list(range(9)))
    assert hit == 4  # the head block survived
    m.check_invariants()


def test_token_ids_may_come_as_a_tensor():
    import torch

    m = _mgr()
    a, _, slots = _add(m, torch.tensor([5, 6, 7]))
    assert m.main.tokens(a) == [5, 6, 7] and slots == [0, 1, 2]
    _append(m, [a], [torch.tensor([8])])
    assert m.main.tokens(a) == [5, 6, 7, 8]
    with pytest.raises(ConfigError):
        _append(m, [a], [torch.tensor([1.5])])


def test_batch_needs_exactly_the_copies_it_makes():
    m = _mgr(n=4)
    a, _, _ = _add(m, [1, 2, 3, 4, 5, 6])  # 2 blocks, the second partly filled
    m.commit([a])
    b = m.fork(a)
    c = m.fork(a)  # the partial block has 3 holders
    assert m.main.pool.num_available == 2
    _, copies = _append(m, [a, b, c], [[7], [8], [9]])  # 2 copies, the last in place
    assert len(copies) == 2 and m.main.pool.num_available == 0
    assert len({m.main.table(x)[1] for x in (a, b, c)}) == 3
    m.check_invariants()


def _trials(specs, prompts, decode: int = 3):
    """Run prompts one after another as the retrieval eval does (admit with the longest hit
    every group serves, store the rest in one step, decode a few tokens, free): the hit
    tokens of each, and the manager."""
    m = BlockManager(specs, 4, b"test")
    hits, nxt = [], 10_000
    for p in prompts:
        sid, hit, _ = m.add(None, p, max_hit_blocks=m.common_hit([p]), rest=False)
        m.step([sid], [p[hit:]])
        m.commit([sid])
        for _ in range(decode):
            nxt += 1
            m.step([sid], [[nxt]])
            m.commit([sid])
        hits.append(hit)
        m.free(sid)
        m.check_invariants()
    return hits, m


def test_recent_window_tail_keeps_what_later_prefix_hits_need():
    """A recent window's tail group (W = 6, its first block kept for the sinks) next to the
    pages' group. Prompts sharing ever shorter prefixes with the first (the retrieval eval's
    sharing order): by default the tail pool is cut back once the window moved past the prompt
    (memory returned), evicting the released blocks a hit needs at its end, so the hits are cut
    short; with keep_cached every hit is as long as without the window and the tail pool stays
    within its cap."""
    import random

    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(160)]
    prompts = [base[:cut] + [rng.randrange(1000, 2000) for _ in range(160 - cut)]
               for cut in (150, 131, 97, 60, 33)]
    glob = GroupSpec(None, 4, 1 << 20)
    no_window, _ = _trials([glob], prompts)
    assert no_window == [0, 128, 96, 60, 32]  # whole blocks shared with the previous prompt
    cut, m = _trials([glob, GroupSpec(6, 4, 1 << 20, keep_first=1)], prompts)
    assert cut == [0, 32, 36, 40, 4] and m.groups[1].pool.num_blocks <= 16  # memory returned
    kept, m = _trials([glob, GroupSpec(6, 4, 64, keep_first=1, keep_cached=True)], prompts)
    assert kept == no_window
    tail = m.groups[1].pool
    assert tail.num_blocks == 40 and tail.num_cached > 32  # its high-water mark, kept


def test_kept_tail_blocks_are_evicted_deepest_first():
    """A tail pool at its cap takes new blocks from its cached ones: those its window released
    while a sequence grew are ranked at its free as a global group ranks them (the deepest
    evicted first), so an unrelated prompt in between leaves a short shared prefix's blocks."""
    import random

    rng = random.Random(0)
    base = [rng.randrange(1000) for _ in range(160)]
    prompts = [base, [7] * 60, base[:40] + [8] * 20]
    glob = GroupSpec(None, 128)
    assert _trials([glob], prompts)[0] == [0, 0, 40]
    hits, m = _trials([glob, GroupSpec(6, 4, 40, keep_first=1, keep_cached=True)], prompts)
    assert hits == [0, 0, 40] and m.groups[1].pool.num_blocks == 40 and m.groups[1].pool.evictions
