"""Offload tiers and prefix hits over every block group of the engine cache (issue 17): a global
group, two sliding windows and a recent window's tail group that keeps its sinks.

Oracles: the same engine loop on a cache without tiers (a resident cap must not change one bit
of any attention output; a prefix hit, from memory or from the store, must give the outputs a
cache that computed every token gives, to fp32 rounding: its queries come in another batch), and the block counts a hit needs in each group (only
the blocks covering the window after the hit, plus the sinks' first blocks).
"""

from __future__ import annotations

import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.offload import MemoryTier, OffloadConfig
from pagedkv.ops import AttentionParams
from pagedkv.ops.recent import RecentWindow

BS, H, D, HQ = 4, 2, 32, 4
WINDOWS = [None, 8, 5]
RECENT = RecentWindow(6, "q8_0", sinks=2)


def _cfg(**kw):
    base = dict(num_layers=3, num_kv_heads=H, head_dim=D, kv_format=["turbo3", "q8_0", "turbo4"],
                block_size=BS, num_blocks=64, sliding_window=WINDOWS, high_precision_layers=0,
                recent_window=RECENT, model_id="toy")
    base.update(kw)
    return CacheConfig(**base)


def _kv(n: int, seed: int = 0):
    """K, V, q rows per layer for positions 0..n-1 (the same prefix gives the same rows, as in
    a model)."""
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, h, D, generator=g) for h in (H, H, HQ)) for _ in range(3)]


def _params(layer):
    return AttentionParams(scale=D ** -0.5, sliding_window=WINDOWS[layer])


def _prefill(c: PagedCache, tokens, rows):
    """Admit `tokens`, store the rows after the hit, attend; returns (seq id, hit, outputs)."""
    new = c.add_sequence(tokens)
    h, n = new.hit_tokens, len(tokens)
    qsl = torch.tensor([0, n - h], dtype=torch.int32)
    outs = []
    for layer, (k, v, q) in enumerate(rows):
        c.store(layer, k[h:n], v[h:n], new)
        outs.append(c.prefill_attention(layer, q[h:n], [new.seq_id], qsl, _params(layer)))
    c.commit(new.seq_id)
    return new.seq_id, h, outs


def _decode(c: PagedCache, sids, rows, pos):
    batch = c.step(sids, [[7]] * len(sids))
    outs = []
    for layer, (k, v, q) in enumerate(rows):
        c.store(layer, k[pos], v[pos], batch)
        outs.append(c.decode_attention(layer, q[pos], sids, _params(layer)))
    c.commit(sids)
    return outs


def test_swap_in_every_group_changes_no_output_bit():
    capped = PagedCache(_cfg(), OffloadConfig(resident_blocks_per_seq=1, swap="memory"))
    plain = PagedCache(_cfg())
    assert len(capped.core.groups) == 4  # global, W=5, W=8, the tail (R=6 keeping its sinks)
    prompts = [[100 + i for i in range(21)], [300 + i for i in range(14)]]
    rows = [_kv(40, seed=s) for s in range(2)]
    sids = {}
    for c in (capped, plain):
        got = [_prefill(c, p, r) for p, r in zip(prompts, rows)]
        sids[id(c)] = [s for s, _, _ in got]
        if c is capped:
            first = [o for _, _, outs in got for o in outs]
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, [o for _, _, o_ in got for o in o_]))
    swapped = [0] * 4
    for t in range(8):
        pos = [21 + t, 14 + t]
        merged = [tuple(torch.stack([r[layer][i][p] for r, p in zip(rows, pos)]) for i in range(3))
                  for layer in range(3)]
        a = _decode(capped, sids[id(capped)], merged, slice(None))
        b = _decode(plain, sids[id(plain)], merged, slice(None))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        for gi, g in enumerate(capped.core.groups):
            for s in sids[id(capped)]:
                assert sum(1 for e in g.table(s) if e >= 0) <= 1  # the cap, in every group
                swapped[gi] += len(g.swapped(s))
    assert all(swapped), swapped  # every group swapped blocks out (the sinks' block included)
    for layer in range(3):  # pages and tails read back exactly, swapped blocks included
        for s, t in zip(sids[id(capped)], sids[id(plain)]):
            for tail in (False, True):
                x, y = capped.gather(layer, s, tail=tail), plain.gather(layer, t, tail=tail)
                assert all(torch.equal(u.nan_to_num(9.0), w.nan_to_num(9.0)) for u, w in zip(x, y))
    capped.pop(sids[id(capped)][0], 1)  # within every group's crop limit
    n_keys = len(capped.swap.keys())
    assert n_keys == sum(len(g.rec_refs) for g in capped.core.groups) > 0
    capped.free(sids[id(capped)][1])  # its records go, in every group
    assert len(capped.swap.keys()) < n_keys
    capped.core.check_invariants()
    assert capped.offload_stats()["swapped_blocks"] > 0
    capped.close()
    assert capped.swap.keys() == []


def _held(c: PagedCache) -> list[int]:
    return [g.pool.num_used for g in c.core.groups]


def test_prefix_hits_with_sliding_groups_from_memory_and_from_the_store():
    store = MemoryTier()
    prompt = [5 + i for i in range(40)]
    rows = _kv(44)
    a = PagedCache(_cfg(), prefix_tier=store)
    _prefill(a, prompt, rows)
    ref = PagedCache(_cfg())  # computes every token
    other = prompt[:34] + [999, 998, 997]
    _, h0, want = _prefill(ref, other, rows)
    assert h0 == 0
    # in memory: the second prompt of the same cache
    sid, hit, got = _prefill(a, other, rows)
    assert hit == 32
    for x, y in zip(got, want):  # the same stored bytes; only the query batch differs (fp32 sums)
        torch.testing.assert_close(x, y[32 - 37:], rtol=1e-5, atol=1e-5)
    # from the store, in a fresh cache: only what each group needs is loaded
    third = prompt[:34] + [555, 556, 557]  # block 8 differs from both stored prompts
    _, _, want = _prefill(PagedCache(_cfg()), third, rows)
    b = PagedCache(_cfg(), prefix_tier=store)
    new = b.add_sequence(third)
    assert new.hit_tokens == 32 and b.tier_hit_tokens == 32
    loaded = [g.pool.num_used for g in b.core.groups]
    # a hit of 8 blocks: every block globally; in W=5 the block of position 28 on (1 block), in
    # W=8 positions 25 on (2), in the tail the sinks' block 0 and positions 27 on (1 + 2)
    assert [g.window for g in b.core.groups] == [None, 5, 8, 6]
    held_hits = [len(g.hit_blocks(8)) for g in b.core.groups]
    assert held_hits == [8, 1, 2, 3]
    after = -(-len(other) // BS) - 8  # blocks of the tokens after the hit
    assert loaded == [h + after for h in held_hits]
    qsl = torch.tensor([0, 5], dtype=torch.int32)
    for layer, (k, v, q) in enumerate(rows):
        b.store(layer, k[32:37], v[32:37], new)
        out = b.prefill_attention(layer, q[32:37], [new.seq_id], qsl, _params(layer))
        torch.testing.assert_close(out, want[layer][-5:], rtol=1e-5, atol=1e-5)
    b.commit(new.seq_id)
    b.core.check_invariants()


def _drop(pool, key):
    """Evict the cached block of `key` (as the LRU would) and put it on the free list."""
    b = pool.lookup(key)
    pool._evict(b)
    pool._free.append(b)


def test_a_sliding_hit_is_shortened_when_its_window_blocks_are_gone():
    c = PagedCache(_cfg(recent_window=None))
    rows = _kv(50)
    prompt = [5 + i for i in range(48)]
    sid, _, _ = _prefill(c, prompt, rows)
    c.free(sid)
    g5 = c.core.groups[c.group_of(2)]  # W = 5: a hit of n blocks needs block n - 1 only (BS 4)
    keys = c.core.chain(prompt)
    assert c.core.match(prompt) == 11
    _drop(g5.pool, keys[10])  # the block a hit of 11 needs in the W=5 group
    assert c.core.match(prompt) == 10  # shortened: a hit of 10 blocks needs block 9 there
    g8 = c.core.groups[c.group_of(1)]
    _drop(g8.pool, keys[8])  # W = 8: hits of 9 and 10 need block 8
    assert c.core.match(prompt) == 8
    new = c.add_sequence(prompt[:40] + [1, 2])
    assert new.hit_tokens == 32
    assert [g.dead(new.seq_id) for g in c.core.groups] == [0, 7, 6]
    c.core.check_invariants()


def _swap_run(c: PagedCache, steps: int = 6):
    """Two prompts, then `steps` packed decode steps; a TierWriteError from a commit (the
    commit took effect, the blocks stay resident) is counted. (sids, outputs, errors)."""
    from pagedkv.offload import TierWriteError

    prompts = [[100 + i for i in range(21)], [300 + i for i in range(14)]]
    rows = [_kv(40, seed=s) for s in range(2)]
    outs, sids, errors = [], [], 0

    def commit(ids):
        nonlocal errors
        try:
            c.commit(ids)
        except TierWriteError:
            errors += 1

    for p, r in zip(prompts, rows):
        new = c.add_sequence(p)
        qsl = torch.tensor([0, len(p)], dtype=torch.int32)
        for layer, (k, v, q) in enumerate(r):
            c.store(layer, k[:len(p)], v[:len(p)], new)
            outs.append(c.prefill_attention(layer, q[:len(p)], [new.seq_id], qsl, _params(layer)))
        commit(new.seq_id)
        sids.append(new.seq_id)
    for t in range(steps):
        batch = c.step(sids, [[7]] * len(sids))
        for layer in range(3):
            k, v, q = (torch.stack([r[layer][i][21 + t if b == 0 else 14 + t]
                                    for b, r in enumerate(rows)]) for i in range(3))
            c.store(layer, k, v, batch)
            outs.append(c.decode_attention(layer, q, sids, _params(layer)))
        commit(sids)
    return sids, outs, errors


def test_swap_reports_and_the_swap_limit_cover_every_group(tmp_path):
    cap = OffloadConfig(resident_blocks_per_seq=1, swap="disk", swap_dir=str(tmp_path / "a"))
    capped = PagedCache(_cfg(), cap)
    sids, _, errors = _swap_run(capped)
    assert errors == 0
    n_groups = len(capped.core.groups)
    total = 0
    for s in sids:
        res, sw = capped.resident_blocks(s), capped.swapped_blocks(s)
        assert len(res) == len(sw) == n_groups and all(r <= 1 for r in res)  # the cap, per group
        for layer in range(3):  # what the tables of each layer's group show as swapped (-1)
            table = capped.block_tables([s], layer=layer)[0].tolist()
            assert [j for j, b in enumerate(table) if b == -1] == sw[capped.group_of(layer)]
        total += sum(len(x) for x in sw)
    assert all(any(capped.swapped_blocks(s)[g] for s in sids) for g in range(n_groups))
    assert capped.offload_stats()["swapped_blocks"] == total
    files = capped.swap.tier.files
    grown = [f.path.stat().st_size for f in files]
    capped.close()

    # a limit every file stays under but their sum does not: refused, never passed
    limit = sum(grown) - 1
    assert max(grown) <= limit
    plain_sids, plain_outs, _ = _swap_run(PagedCache(_cfg()))
    tight = PagedCache(_cfg(), OffloadConfig(resident_blocks_per_seq=1, swap="disk",
                                             swap_dir=str(tmp_path / "b"), swap_limit_bytes=limit))
    _, outs, errors = _swap_run(tight)
    assert errors > 0
    assert sum(f.path.stat().st_size for f in tight.swap.tier.files) <= limit
    assert len(outs) == len(plain_outs) and all(torch.equal(a, b) for a, b in zip(outs, plain_outs))
    tight.core.check_invariants()
    tight.close()
