"""Property test: the cache's random add/append/step/fork/pop/free/reset/evict machine, run on a
PagedCache with offload tiers: a resident cap of one block (swap in memory) and a prefix store.

Every rule and invariant of `test_cache_stateful.CacheMachine` applies unchanged (reference
counts, no block in two places, and every sequence's K/V reading back bit for bit, swapped blocks
included, through `gather`); on top: each sequence keeps at most one committed full block
resident beyond its last block, swap records are exactly those referenced, and step tables show
-1 where a block is swapped out. `reset_prefix_cache` empties the in-memory prefix index, so later
prompts load their prefixes from the store.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

import test_cache_stateful as base  # the plain cache's machine: rules, invariants, data banks
from pagedkv.alloc.swapstate import swapped_record
from pagedkv.errors import CacheFull
from pagedkv.cache import PagedCache
from pagedkv.offload import MemoryTier, OffloadConfig


class TieredMachine(base.CacheMachine):
    def __init__(self):
        super().__init__()
        self.store = MemoryTier()
        self.cache = PagedCache(
            dataclasses.replace(base._config(), model_id="stateful"), OffloadConfig(resident_blocks_per_seq=1, swap="memory", prefetch=False),
            prefix_tier=self.store)

    @rule(data=st.data())
    def decode_step(self, data):
        live = sorted(self.tokens, key=str)
        if not live:
            return
        batch = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=4, unique=True))
        toks = [[data.draw(st.integers(0, 3))] for _ in batch]
        before = self._snapshot()
        try:
            step = self.cache.step(batch, toks)
        except CacheFull:
            assert self._snapshot() == before
            return
        swapped = {s: set(self.cache.swapped_blocks(s)[0]) for s in batch}  # as of the step
        rows = [base.rows_after(self._last_row(s), t)[0] for s, t in zip(batch, toks)]
        self._store(step, rows)
        self.cache.commit(batch)
        for s, t, r in zip(batch, toks, rows):
            self.tokens[s] += t
            self.rows[s].append(r)
        assert step.seq_lens.tolist() == [len(self.tokens[s]) for s in batch]
        bt = step.block_tables
        for i, s in enumerate(batch):
            got = bt[i].tolist()
            assert [j for j, b in enumerate(got) if b == -1] == sorted(swapped[s])

    @invariant()
    def swap_bookkeeping(self):
        c = self.cache
        keys = []
        for gi, g in enumerate(c.core.groups):
            refs: dict = {}
            for s in c.sequence_ids():
                table = g.table(s)
                committed_full = g.committed(s) // base.BS
                for j in g.swapped(s):  # only full committed blocks; the last one only if full
                    assert j < committed_full and (j < len(table) - 1 or c.seq_len(s) % base.BS == 0)
                    rid = swapped_record(table[j])
                    refs[rid] = refs.get(rid, 0) + 1
                if g.committed(s) == c.seq_len(s):  # the cap holds after a commit, every group
                    n = len(table)
                    assert c.resident_blocks(s)[gi] <= max(1, n - committed_full + (c.seq_len(s) % base.BS > 0))
            assert refs == g.rec_refs
            keys += [c.swap.key_of(r, gi) for r in refs]
        assert sorted(self.cache.swap.tier.keys()) == sorted(keys) == sorted(c.swap.keys())


TieredMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestTieredStateful = TieredMachine.TestCase


class GroupedTieredMachine(TieredMachine):
    """The same with every kind of block group: layer 1 slides (W = 6) and both layers keep a
    recent window of 5 tokens in turbo8 with 2 attention sinks (a tail group that keeps each
    sequence's first block); the cap and the prefix store work in every group, and every
    layer's pages and tails read back bit for bit."""

    def __init__(self):
        base.CacheMachine.__init__(self)
        self.store = MemoryTier()
        self.cache = PagedCache(
            base.grouped_config(model_id="stateful",
                                recent_window=dataclasses.replace(base.RECENT, sinks=2)),
            OffloadConfig(resident_blocks_per_seq=1, swap="memory", prefetch=False),
            prefix_tier=self.store)
        assert [g.window for g in self.cache.core.groups] == [None, 6, 5]

    def _allocate(self, sid, tokens):
        return self.cache.step([sid], [tokens])  # every group's slots


GroupedTieredMachine.TestCase.settings = settings(TieredMachine.TestCase.settings,
                                                   max_examples=12)
TestGroupedTieredStateful = GroupedTieredMachine.TestCase
