"""The block manager: sequences over every block group, all or nothing, and the per-step plan.

A cache's layers are split into block groups (the global layers; one group per distinct sliding
window). Each group has its own `BlockPool` (block ids address the same slots of every layer of
that group) and its own `SequenceManager`; a sequence id names one sequence in every group. Every
operation here checks every group first and raises (CacheFull, ConfigError, InvalidInput) before
changing any of them, so a failed step leaves every group, and every layer, as it was.

`step` returns a frozen `StepPlan` the data plane applies before storing: per group the pool
size to have (growth), block moves with the size to cut to (a sliding group that left most of its
blocks behind compacts), copy-on-write copies, and the slots of the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

from ..errors import CacheFull, ConfigError
from .hashing import Salt
from .pool import BlockPool
from .sequences import SequenceManager, Tokens, check_tokens


@dataclass(frozen=True)
class GroupSpec:
    """One block group: its sliding window (None = global), initial and maximum pool size
    (blocks; max None = fixed at initial), and how many leading blocks of every sequence a
    sliding group never releases (a recent window's attention sinks).

    keep_cached: a sliding group's compaction keeps its cached blocks (released, keyed: the
    blocks a later prompt's prefix hit needs at the hit's end) instead of evicting them to
    return memory; they then leave only when an allocation needs their ids (LRU), as in the
    global group. A hit of n blocks needs, in a group of window W, the blocks covering
    positions [n*bs - W + 1, n*bs) besides the kept first ones, so a hit at any boundary of a
    stored prompt needs every block of it: the price is the group's pool staying at its
    high-water mark (within max_blocks) while its blocks are cached."""

    window: Optional[int]
    initial_blocks: int
    max_blocks: Optional[int] = None
    keep_first: int = 0
    keep_cached: bool = False


@dataclass(frozen=True)
class GroupStep:
    """What the data plane does to one group's pools before storing a step."""

    moves: tuple[tuple[int, int], ...]  # (src, dst) block moves, then cut the pools...
    num_blocks: int  # ...or grow them to this many blocks
    copies: tuple[tuple[int, int], ...]  # copy-on-write (src, dst), after moves / growth
    slots: tuple[int, ...]  # the new tokens' slots, sequences in step order


@dataclass(frozen=True)
class StepPlan:
    seq_ids: tuple[Hashable, ...]
    counts: tuple[int, ...]
    groups: tuple[GroupStep, ...]


class BlockManager:
    """Sequences over several block groups (see module doc). Plain Python, no torch.

    namespace: mixed into prefix keys. A prefix hit is the same leading blocks in every group:
    all of them in the global group, only those a query after the hit can see in a sliding one
    (`SequenceManager.hit_blocks`); `match` finds the longest hit every group can serve."""

    def __init__(self, specs: Sequence[GroupSpec], block_size: int, namespace: bytes = b"", *,
                 trace: bool = False):
        if not specs:
            raise ConfigError("a block manager needs at least one group")
        self.block_size = block_size
        self.specs = tuple(specs)
        self.groups = [
            SequenceManager(BlockPool(g.initial_blocks, trace=trace, max_blocks=g.max_blocks),
                            block_size, namespace, window=g.window, keep_first=g.keep_first)
            for g in specs]
        self.main = self.groups[0]

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.main

    def ids(self) -> list[Hashable]:
        return self.main.ids()

    def length(self, seq_id: Hashable) -> int:
        return self.main.length(seq_id)

    # ---- prefix hits --------------------------------------------------------------------------
    def chain(self, tokens: Sequence[int], salt: Salt = None) -> list[bytes]:
        """The prompt's chain keys (the same in every group: one namespace)."""
        return self.main.chain(tokens, salt)

    def feasible(self, keys: Sequence[bytes], cap: int) -> int:
        """The longest hit (at most cap leading blocks) every group holds now (no change)."""
        n = min(cap, len(keys))
        while True:
            m = n
            for g in self.groups:
                m = g.feasible(keys, m)
            if m == n:
                return n
            n = m

    def match(self, tokens: Sequence[int], salt: Salt = None) -> int:
        """Leading full blocks of `tokens` every group can serve as a hit now (no change)."""
        return self.feasible(self.chain(tokens, salt), len(tokens))

    def common_hit(self, prompts: Sequence[Sequence[int]], salt: Salt = None) -> int:
        """The longest hit (blocks) every prompt can take at once (a batch that shares one
        length): a shorter hit of one prompt is not always servable (its window's blocks may be
        gone), so each prompt is asked again at the others' length until they agree."""
        keys = [self.chain(p, salt) for p in prompts]
        n = min((len(k) for k in keys), default=0)
        while True:
            m = min((self.feasible(k, n) for k in keys), default=0)
            if m == n:
                return n
            n = m

    def load_prefix(self, tokens: Sequence[int], salt: Salt, fetch, write) -> tuple[int, int]:
        """Bring the prompt's longest hit up from a tier below memory (`tierload.load_prefix`):
        (hit blocks in memory before, blocks loaded)."""
        from .tierload import load_prefix

        return load_prefix(self, tokens, salt, fetch, write)

    # ---- sequences ----------------------------------------------------------------------------
    def add(self, seq_id: Optional[Hashable], tokens: Sequence[int], salt: Salt = None, *,
            rest: bool = True, max_hit_blocks: Optional[int] = None
            ) -> tuple[Hashable, int, tuple[tuple[int, ...], ...]]:
        """Admit a sequence in every group (prefix hits in whole blocks, see
        `SequenceManager.add`; the longest hit every group serves, at most max_hit_blocks).
        seq_id None = a new int id. Returns (seq_id, hit tokens, per group the slots of the
        tokens after the hits). rest=False holds the hits only. CacheFull before any change."""
        if isinstance(tokens, int) and not isinstance(tokens, bool):
            raise ConfigError("add_sequence needs the prompt's token ids, not a count")
        n, toks, _ = check_tokens(tokens, "add_sequence")
        keys = self.chain(toks, salt)
        seq_id = self.main._new_id(seq_id)
        hit = self.feasible(keys, len(keys) if max_hit_blocks is None else max_hit_blocks)
        held = -(-(n if rest else hit * self.block_size) // self.block_size)
        for g in self.groups:
            cost = g.hit_cost(keys, hit, held)
            if cost > g.pool.headroom:
                raise CacheFull(f"add_sequence of {n} tokens needs {cost} blocks "
                                f"({hit} prefix hits); {g.pool.headroom} available")
        slots = tuple(tuple(g.add(toks, salt, seq_id, max_hit_blocks=hit, rest=rest, keys=keys)[2])
                      for g in self.groups)
        return seq_id, hit * self.block_size, slots

    def step(self, seq_ids: Sequence[Hashable], tokens: Sequence[Tokens]) -> StepPlan:
        """New tokens (ids or counts) for several distinct sequences in every group."""
        if len(seq_ids) != len(tokens):
            raise ConfigError(f"step: {len(seq_ids)} sequence ids but {len(tokens)} token lists")
        if len(set(seq_ids)) != len(seq_ids):
            raise ConfigError("step: a sequence id appears twice in the batch")
        parsed = [check_tokens(t, "step") for t in tokens]
        counts = [p[0] for p in parsed]
        demands = [g.demand(seq_ids, counts) for g in self.groups]
        for g, (need, freed) in zip(self.groups, demands):
            if not g.fits(need, freed):
                raise g.full_error(sum(counts), len(seq_ids), need, freed)
        out = []
        for g, spec, (need, freed) in zip(self.groups, self.specs, demands):
            moves: list[tuple[int, int]] = []
            if g.window is not None:
                g.reclaim(seq_ids, counts)
                pool = g.pool
                live = pool.num_used + (pool.num_cached if spec.keep_cached else 0)
                target = max(spec.initial_blocks, 2 * (live + need))
                if 2 * target <= pool.num_blocks:  # most blocks left the window: shrink
                    moves = g.compact(target)
            slots, copies = g.extend(seq_ids, parsed)
            out.append(GroupStep(tuple(moves), g.pool.num_blocks, tuple(copies), tuple(slots)))
        return StepPlan(tuple(seq_ids), tuple(counts), tuple(out))

    def commit(self, seq_ids: Sequence[Hashable]) -> None:
        for g in self.groups:
            g.commit(list(seq_ids))

    def fork(self, seq_id: Hashable, new_id: Optional[Hashable] = None) -> Hashable:
        """A copy of `seq_id` in every group sharing its blocks (new_id None = a new int id)."""
        for g in self.groups:
            g._get(seq_id)
        new_id = self.main._new_id(new_id)
        for g in self.groups:
            g.fork(seq_id, new_id)
        return new_id

    def check_pop(self, seq_id: Hashable, n: int) -> list[Optional[int]]:
        """Validate `pop` in every group; the record each must read back (or None)."""
        return [g.pop_needs_swap_in(seq_id, n) for g in self.groups]

    def pop(self, seq_id: Hashable, n: int) -> list[Optional[int]]:
        """Drop the last n tokens in every group (checked in all first). Returns per group the
        pool block a swapped record must be read back into (or None)."""
        self.check_pop(seq_id, n)
        return [g.pop(seq_id, n) for g in self.groups]

    def free(self, seq_id: Hashable) -> None:
        for g in self.groups:
            g._get(seq_id)
        for g, spec in zip(self.groups, self.specs):
            g.free(seq_id, spec.keep_cached)

    def clear(self) -> None:
        for g in self.groups:
            g.clear()

    def check_invariants(self) -> None:
        """Every group: sequences, records and pool (see `check.check_sequences`)."""
        from .check import check_sequences

        ids = set(self.main.ids())
        for g in self.groups:
            assert set(g.ids()) == ids, "groups hold different sequences"
            lens = {sid: g.length(sid) for sid in ids}
            assert lens == {sid: self.main.length(sid) for sid in ids}, "group lengths differ"
            check_sequences(g)
