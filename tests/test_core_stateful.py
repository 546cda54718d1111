"""Property test: the block manager (every group, growth, compaction, window reclaim, prefix hits
in sliding groups, swap as an entry state in every group, a prefix tier below memory for every
group) driven by random add / step / commit / fork / pop / free against a naive model, >= 10^4
steps per run.

The naive model is a dict of token lists. The data plane is simulated here: per group a dict
slot -> content, where the content of position p is a hash of the sequence's tokens 0..p (so a
wrong prefix hit, a lost copy-on-write or a wrong move shows up as wrong data); plans are applied
exactly as a cache applies them (moves, cut / growth, copies, then the new tokens' slots);
swapped records and the prefix tier are dicts. After every step: the one invariant check over
every group and pool, and every sequence reads back its content through its tables (resident
blocks, swapped records) wherever a query can still see it. Failed operations (CacheFull, a crop
past a released block) must leave every table and pool exactly as they were.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.alloc.manager import BlockManager, GroupSpec
from pagedkv.alloc.swapstate import RELEASED, swapped_record
from pagedkv.errors import CacheFull, InvalidInput

BS = 4
STEMS = ([], [1, 2, 3, 0, 1, 2, 3, 0], [1, 2, 3, 0, 2, 2, 2, 2, 0], [3, 3, 3, 3, 1])
SETTINGS = settings(max_examples=75, stateful_step_count=100, deadline=None,
                    suppress_health_check=list(HealthCheck))


def content(tokens: list[int], p: int) -> int:
    return hash(tuple(tokens[:p + 1]))


class CoreMachine(RuleBasedStateMachine):
    SPECS: tuple = ()
    CAP = None  # resident blocks per sequence (swap) or None
    TIER = False  # a prefix tier below memory

    def __init__(self):
        super().__init__()
        self.m = BlockManager(self.SPECS, BS, b"prop")
        self.data = [dict() for _ in self.SPECS]  # group -> slot -> content
        self.records: dict[int, list] = {}  # swap record id -> the block's slot contents
        self.tier: dict[bytes, list] = {}  # prefix chain key -> a full block's contents
        self.seqs: dict[int, list[int]] = {}  # the naive model
        self.next_id = 0
        self.steps = 0
        self.loaded = 0
        self.window_hits = 0

    # ---- helpers ------------------------------------------------------------------------------
    def snapshot(self):
        return [(sorted((s, list(g.table(s)), g.length(s)) for s in g.ids()),
                 g.pool.num_free, g.pool.num_used, g.pool.num_cached, g.pool.num_blocks)
                for g in self.m.groups]

    def apply(self, plan, rows):
        """The data plane: moves, copies, then store each new token's content at its slot."""
        for gi, (g, gs) in enumerate(zip(self.m.groups, plan.groups)):
            d = self.data[gi]
            for src, dst in gs.moves:
                for o in range(BS):
                    if src * BS + o in d:
                        d[dst * BS + o] = d[src * BS + o]
            for k in [k for k in d if k >= gs.num_blocks * BS]:
                del d[k]
            for src, dst in gs.copies:
                for o in range(BS):
                    if src * BS + o in d:
                        d[dst * BS + o] = d[src * BS + o]
            i = 0
            for sid, n in zip(plan.seq_ids, plan.counts):
                toks = self.seqs[sid]
                for p in range(len(toks) - n, len(toks)):
                    d[gs.slots[i]] = content(toks, p)
                    i += 1
            assert i == len(gs.slots)

    def drop_dead(self):
        for gi, g in enumerate(self.m.groups):
            for rid in g.drain_dead_records():
                del self.records[gi, rid]

    def after_commit(self, sids):
        """The tiers, in every group: publish newly full blocks, then swap down to the cap."""
        for gi, g in enumerate(self.m.groups):
            d = self.data[gi]
            for sid in sids:
                if self.TIER:
                    for b, key in g.newly_full(sid):
                        self.tier.setdefault((gi, key), [d[b * BS + o] for o in range(BS)])
                if self.CAP is not None:
                    todo = g.swap_candidates(sid, self.CAP)
                    for i, b, rid, new in todo:
                        if new:
                            self.records[gi, rid] = [d[b * BS + o] for o in range(BS)]
                    g.swapped_out(sid, todo)
                    # the cap holds in every group (the last block always stays)
                    assert sum(1 for e in g.table(sid) if e >= 0) <= max(self.CAP, 1)
        self.drop_dead()

    def load_from_tier(self, toks):
        """The prefix tier: the longest hit memory and the tier serve together, through the
        block manager's own walk (`load_prefix`); loaded blocks are cached, keyed blocks."""
        def fetch(gi, keys):
            for key in keys:
                yield self.tier.get((gi, key))

        def write(gi, b, payload):
            for o, v in enumerate(payload):
                self.data[gi][b * BS + o] = v

        before, loaded = self.m.load_prefix(toks, None, fetch, write)
        self.loaded += loaded
        assert self.m.match(toks) >= before

    # ---- rules --------------------------------------------------------------------------------
    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 3), max_size=9))
    def add(self, stem, tail):
        toks = stem + tail
        if not toks:
            return
        before = self.snapshot()
        if self.TIER:
            self.load_from_tier(toks)
        sid, self.next_id = self.next_id, self.next_id + 1
        try:
            hit = self.m.add(sid, toks, rest=False)[1]
        except CacheFull:  # the tier loads nothing for an admission that cannot fit
            assert self.snapshot() == before
            return
        assert hit % BS == 0 and hit < len(toks)
        if hit and any(g.dead(sid) for g in self.m.groups):
            self.window_hits += 1  # a hit whose sliding groups hold only the window's blocks
        self.seqs[sid] = toks[:hit]
        self.extend([sid], [toks[hit:]], known=True, commit=True)

    def extend(self, sids, new, known, commit):
        before = self.snapshot()
        for sid, t in zip(sids, new):
            self.seqs[sid] = self.seqs[sid] + t
        try:
            plan = self.m.step(sids, [t if known else len(t) for t in new])
        except CacheFull:
            for sid, t in zip(sids, new):
                del self.seqs[sid][len(self.seqs[sid]) - len(t):]
            assert self.snapshot() == before
            return
        self.apply(plan, sids)
        self.drop_dead()
        if commit:
            self.m.commit(sids)
            self.after_commit(sids)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), known=st.booleans(), commit=st.booleans())
    def step(self, data, known, commit):
        ids = sorted(self.seqs)
        sids = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        new = [data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=5)) for _ in sids]
        self.extend(sids, new, known, commit)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.commit([sid])
        self.after_commit([sid])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        new, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(sid, new)
        self.seqs[new] = list(self.seqs[sid])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def pop(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        n = data.draw(st.integers(0, len(self.seqs[sid])))
        before = self.snapshot()
        try:
            rids = self.m.check_pop(sid, n)
            back = self.m.pop(sid, n)
        except (InvalidInput, CacheFull):
            assert self.snapshot() == before
            return
        for gi, (rid, b) in enumerate(zip(rids, back)):
            assert (rid is None) == (b is None)
            if b is not None:  # the new last block was swapped: read it back
                for o, v in enumerate(self.records[gi, rid]):
                    self.data[gi][b * BS + o] = v
        del self.seqs[sid][len(self.seqs[sid]) - n:]
        self.drop_dead()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.m.free(sid)
        del self.seqs[sid]
        self.drop_dead()

    # ---- checks -------------------------------------------------------------------------------
    @invariant()
    def consistent(self):
        self.steps += 1
        self.m.check_invariants()
        assert sorted(self.m.ids()) == sorted(self.seqs)
        for gi, g in enumerate(self.m.groups):
            d = self.data[gi]
            for sid, toks in self.seqs.items():
                assert g.length(sid) == len(toks)
                table = g.table(sid)
                seen_from = 0 if g.window is None else max(0, len(toks) - g.window)
                for p in range(g.dead(sid) * BS, len(toks)):
                    e = table[p // BS]
                    assert e != RELEASED or p < seen_from, (sid, p)
                    rid = swapped_record(e)
                    got = d.get(e * BS + p % BS) if rid is None else self.records[gi, rid][p % BS]
                    assert got == content(toks, p), (gi, sid, p, e)
        assert set(self.records) == {(gi, r) for gi, g in enumerate(self.m.groups)
                                     for r in g.rec_refs}


class SlidingCore(CoreMachine):
    """A global group and two sliding ones (W = 6, and W = 3 as a recent window's tail group
    is): growth, window reclaim, compaction, crop limits, all or nothing across three groups."""

    SPECS = (GroupSpec(None, 4, 12), GroupSpec(6, 2, 12), GroupSpec(3, 2, 12))


class TieredCore(CoreMachine):
    """The whole core: a global group, a sliding one (W = 6) and a recent window's tail group
    (W = 3, keeping the first block for its sinks), prefix hits in all three, a resident cap of
    2 blocks per sequence in every group (swap) and a prefix tier holding every group's blocks
    (a hit loads only what each group needs)."""

    SPECS = (GroupSpec(None, 6, 14), GroupSpec(6, 2, 12), GroupSpec(3, 2, 12, keep_first=1))
    CAP = 2
    TIER = True


STEPS: list[int] = []
LOADED = [0, 0]  # blocks loaded from the tier, hits that left blocks before a window out


def _run(machine) -> None:
    class Counted(machine):
        def teardown(self):
            STEPS.append(self.steps)
            LOADED[0] += self.loaded
            LOADED[1] += self.window_hits

    Counted.TestCase.settings = SETTINGS
    Counted.TestCase().runTest()


def test_core_against_naive_model():
    """Both machines; the invariant runs once per step: >= 10^4 steps in all."""
    _run(SlidingCore)
    _run(TieredCore)
    print(f"{sum(STEPS)} steps in {len(STEPS)} runs, {LOADED[0]} blocks loaded from the tier, "
          f"{LOADED[1]} windowed hits")
    assert sum(STEPS) >= 10_000 and LOADED[0] > 0 and LOADED[1] > 0
    assert sum(STEPS) >= 10_000
