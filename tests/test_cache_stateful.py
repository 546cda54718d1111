"""Property test: random add/append/step/fork/pop/free/reset/evict against a naive model.

The naive model is a dict of token lists. K/V of position p is a fixed random row chosen by a
running hash of the tokens up to p (so it depends on the whole prefix, as in a real model, and a
wrong prefix hit shows up as wrong data). After every step: reference counts equal the references
the sequences hold, free + used + cached == total, no block is in two places, every sequence's
tokens match, and both layers read back exactly: layer 0 is bf16 (bank rows are bf16 values),
layer 1 an asymmetric compressed format whose expected value is the codec round trip of the row
(encoding is row-wise deterministic, so the cache must reproduce it bit for bit).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.codecs.reference import roundtrip
from pagedkv.ops.recent import RecentWindow
from pagedkv.errors import CacheFull, InvalidInput

BS = 4
DIMS = ((1, 16), (2, 16))
FORMATS = ("bf16", "fp8k_turbo3v")
BANK = 257

_gen = torch.Generator().manual_seed(1234)
# [layer] -> (K rows [BANK, H, D], V rows) as stored-and-read-back values
_RAW = [(torch.randn(BANK, h, d, generator=_gen).bfloat16().float(),
         torch.randn(BANK, h, d, generator=_gen).bfloat16().float()) for h, d in DIMS]


def _config(num_blocks: int = 20) -> CacheConfig:
    return CacheConfig(num_layers=2, num_kv_heads=1, head_dim=16, layer_dims=DIMS,
                       kv_format=FORMATS, high_precision_layers=0, block_size=BS,
                       num_blocks=num_blocks, trace=True)


def _expected_banks(cfg: CacheConfig):
    out = []
    for (k, v), spec in zip(_RAW, cfg.layers):
        out.append((roundtrip(spec.format.k, k), roundtrip(spec.format.v, v)))
    return out


EXPECTED = _expected_banks(_config())


def rows_after(prev: int, tokens) -> list[int]:
    """Running prefix hash -> bank row of each new token."""
    out = []
    for t in tokens:
        prev = (prev * 131 + t + 17) % BANK
        out.append(prev)
    return out


# shared stems make prefix hits (and shared, keyed blocks) common
STEMS = ([], [1, 2, 3, 0, 1, 2, 3, 0], [1, 2, 3, 0, 2, 2, 2, 2, 0], [3, 3, 3, 3, 1])
tokens_st = st.builds(lambda stem, tail: list(stem) + tail, st.sampled_from(STEMS),
                      st.lists(st.integers(0, 3), min_size=0, max_size=8))
salt_st = st.sampled_from([None, "tenant-a"])


class CacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.cache = PagedCache(_config())
        self.tokens: dict = {}  # seq id -> token ids (-1 = unknown)
        self.rows: dict = {}  # seq id -> bank row per position

    # ---- helpers ------------------------------------------------------------------------
    def _store(self, slots, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.long)
        for layer, (k, v) in enumerate(_RAW):
            self.cache.store(layer, k[idx], v[idx], slots)

    def _allocate(self, sid, tokens):
        return self.cache.allocate(sid, tokens)

    def _snapshot(self):
        c = self.cache
        return ({s: (c.tokens(s), [list(g.table(s)) for g in c.core.groups]) for s in c.sequence_ids()},
                [(g.pool.num_free, g.pool.num_cached, g.pool.num_used, g.pool.num_blocks)
                 for g in c.core.groups])

    def _last_row(self, sid) -> int:
        return self.rows[sid][-1] if self.rows[sid] else 0

    # ---- rules --------------------------------------------------------------------------
    @rule(target=seqs, tokens=tokens_st, salt=salt_st)
    def add(self, tokens, salt):
        before = self._snapshot()
        try:
            new = self.cache.add_sequence(tokens, salt=salt)
        except CacheFull:
            assert self._snapshot() == before
            return None
        hit = new.hit_tokens
        assert hit % BS == 0 and (hit < len(tokens) or hit == 0)
        rows = rows_after(0, tokens)
        assert new.slot_mapping.shape == (len(tokens) - hit,)
        self._store(new, rows[hit:])
        self.cache.commit(new.seq_id)
        self.tokens[new.seq_id] = list(tokens)
        self.rows[new.seq_id] = rows
        return new.seq_id

    @rule(sid=seqs, tokens=st.lists(st.integers(0, 3), min_size=0, max_size=6),
          known=st.booleans(), commit=st.booleans())
    def append_rule(self, sid, tokens, known, commit):
        self.append(sid, tokens, known, commit)

    def append(self, sid, tokens, known, commit):
        if sid not in self.tokens:
            return
        before = self._snapshot()
        try:
            slots = self._allocate(sid, tokens if known else len(tokens))
        except CacheFull:
            assert self._snapshot() == before
            return
        ids = tokens if known else [-1] * len(tokens)
        rows = rows_after(self._last_row(sid), ids)
        self._store(slots, rows)
        if commit:
            self.cache.commit(sid)
        self.tokens[sid] += ids
        self.rows[sid] += rows

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
        rows = [rows_after(self._last_row(s), t)[0] for s, t in zip(batch, toks)]
        self._store(step, rows)
        self.cache.commit(batch)
        for s, t, r in zip(batch, toks, rows):
            self.tokens[s] += t
            self.rows[s].append(r)
        assert step.seq_lens.tolist() == [len(self.tokens[s]) for s in batch]
        assert step.query_start_loc.tolist() == list(range(len(batch) + 1))
        bt = step.block_tables
        for i, s in enumerate(batch):
            table = list(self.cache.seqs.table(s))
            assert bt[i, :len(table)].tolist() == table

    @rule(target=seqs, sid=seqs)
    def fork(self, sid):
        if sid not in self.tokens:
            return None
        child = self.cache.fork(sid)
        self.tokens[child] = list(self.tokens[sid])
        self.rows[child] = list(self.rows[sid])
        return child

    @rule(sid=seqs, data=st.data())
    def pop_rule(self, sid, data):
        if sid not in self.tokens:
            return
        self.pop(sid, data.draw(st.integers(0, len(self.tokens[sid]))))

    def pop(self, sid, n):
        before = self._snapshot()
        try:
            self.cache.pop(sid, n)
        except InvalidInput:  # past a sliding group's released blocks: nothing changed
            assert self._snapshot() == before
            return
        if n:
            del self.tokens[sid][-n:]
            del self.rows[sid][-n:]

    @rule(sid=seqs, n=st.integers(1, 6), tokens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def speculate(self, sid, n, tokens):
        """Reject the last n tokens, then write others (into a block that may be keyed/shared)."""
        if sid not in self.tokens:
            return
        self.pop(sid, min(n, len(self.tokens[sid])))
        self.append(sid, tokens, True, True)

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid not in self.tokens:
            return
        self.cache.free(sid)
        del self.tokens[sid]
        del self.rows[sid]

    @rule(sid=seqs)
    def reset(self, sid):
        if sid not in self.tokens:
            return
        self.cache.reset(sid)
        self.tokens[sid] = []
        self.rows[sid] = []

    @rule()
    def reset_prefix_cache(self):
        pools = [g.pool for g in self.cache.core.groups]
        cached = sum(p.num_cached for p in pools)
        assert self.cache.reset_prefix_cache() == cached
        assert all(p.num_cached == 0 and p.index_size() == 0 for p in pools)

    # ---- invariants ---------------------------------------------------------------------
    @invariant()
    def bookkeeping(self):
        c = self.cache
        pool = c.pool
        held = [0] * pool.num_blocks
        for s in c.sequence_ids():
            for b in c.seqs.table(s):
                if b >= 0:  # a swapped entry (-2 - record) holds a record, not a block
                    held[b] += 1
                else:
                    assert c.tiers is not None and b <= -2, f"{s!r}: entry {b} without swap"
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == held
        free, cached = pool.free_blocks(), pool.cached_blocks()
        used = [b for b in range(pool.num_blocks) if held[b]]
        assert len(free) + len(cached) + len(used) == pool.num_blocks
        assert len(set(free) | set(cached) | set(used)) == pool.num_blocks  # no block twice
        st_ = c.stats()
        assert (st_.blocks_free, st_.blocks_cached, st_.blocks_used) == (len(free), len(cached), len(used))
        c.core.check_invariants()
        last = {}
        for e in c.trace:  # the trace's last word on each block is its current ref count
            last[e.block] = e.ref
        assert all(last.get(b, 0) == pool.ref_count(b) for b in range(pool.num_blocks))

    @invariant()
    def contents(self):
        c = self.cache
        assert sorted(c.sequence_ids(), key=str) == sorted(self.tokens, key=str)
        for s, toks in self.tokens.items():
            assert c.tokens(s) == toks
            idx = torch.tensor(self.rows[s], dtype=torch.long)
            for layer, (ek, ev) in enumerate(EXPECTED):
                self._same(c.gather(layer, s), (ek[idx], ev[idx]), c.config.layers[layer].sliding_window,
                           (s, layer))
            for layer, (ek, ev) in enumerate(TAIL_EXPECTED if c.tails is not None else ()):
                self._same(c.gather(layer, s, tail=True), (ek[idx], ev[idx]),
                           c.config.recent_window.tokens, (s, layer, "tail"))

    @staticmethod
    def _same(got, want, window, what):
        """Stored rows equal the codec round trip; a sliding group's released rows (NaN) are
        only ever positions no query of the next tokens (positions >= n) can see."""
        n = want[0].shape[0]
        for g, w in zip(got, want):
            kept = ~torch.isnan(g).flatten(1).any(1)
            assert torch.equal(g[kept], w[kept]), what
            if window is None:
                assert kept.all(), what
            else:
                assert kept[max(0, n - window + 1):].all(), what


CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheStateful = CacheMachine.TestCase

# several block groups: layer 1 slides (W = 6) and both layers keep a recent window of 5 tokens
# in turbo8 (a third group): window reclaim, compaction and crop limits through the engine cache
RECENT = RecentWindow(5, "turbo8")
TAIL_EXPECTED = [(roundtrip(RECENT.codec, k), roundtrip(RECENT.codec, v)) for k, v in _RAW]


def grouped_config(**kw) -> CacheConfig:
    """`_config` with layer 1 sliding (W = 6) and a recent window on both layers."""
    return dataclasses.replace(_config(), **{"sliding_window": [None, 6], "recent_window": RECENT,
                                             **kw})


class GroupedCacheMachine(CacheMachine):
    def __init__(self):
        super().__init__()
        self.cache = PagedCache(grouped_config())
        assert len(self.cache.core.groups) == 3

    def _allocate(self, sid, tokens):
        return self.cache.step([sid], [tokens])  # every group's slots


GroupedCacheMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestGroupedCacheStateful = GroupedCacheMachine.TestCase
