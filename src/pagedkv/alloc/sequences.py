"""Sequences over one block pool: block tables, prefix hits, copy-on-write, rollback, window
reclaim and swapped entries.

Plain Python, no torch. A sequence is its token ids, its block table (`array('i')`, logical block
-> entry) and how many of its tokens are *committed* (their K/V written in every layer). An entry
is a resident pool block (>= 0), `RELEASED` (-1: a sliding-window group dropped a block no query
can see any more) or a swapped record (`-2 - rid`, see `swapped_record`): swap is a state of the
entry, counted like a block (records have reference counts here, a record is deleted when its last
entry goes). Positions map to slots as `slot(p) = table[p // bs] * bs + p % bs`.

Life of a token: `extend` (through `BlockManager.step`, after `demand` checked the capacity)
hands out its slot (copying a shared, partly filled last block first: the returned `copies` list
of `(src, dst)` must be applied to every layer's pools before anything is stored); the caller
stores K/V there; `commit` marks the tokens written and keys every newly
full block in the prefix index (the one place the chain is computed: `_Seq.hashes`). Only
committed full blocks are ever keyed, so a prefix hit never returns unwritten data. Tokens whose
ids are unknown (a step given a count) are stored normally but the blocks holding them,
and every later block of that sequence, are never keyed.

Every method validates first and raises (ConfigError, UnknownSequence, CacheFull) before any
state changes. `check.check_sequences` is the invariant check.
"""

from __future__ import annotations

import sys
from array import array
from itertools import count
from typing import Hashable, Iterable, Optional, Sequence, Union

from ..compose import calls
from ..errors import CacheFull, ConfigError, InvalidInput, UnknownSequence
from .hashing import Salt
from .pool import BlockPool
from .growth import WindowedAppend
from .prefixchain import PrefixChain
from .shape import GroupShape
from .swapstate import RELEASED, TableEntries, swapped_record

_NO_UNKNOWN = sys.maxsize
_MAX_TOKEN = (1 << 63) - 1
Tokens = Union[int, Sequence[int]]


class _Seq:
    __slots__ = ("tokens", "table", "committed", "first_unknown", "root", "hashes", "dead",
                 "published")

    def __init__(self, root: bytes):
        self.tokens: list[int] = []  # -1 where the id is unknown
        self.table = array("i")
        self.committed = 0
        self.first_unknown = _NO_UNKNOWN  # position of the first unknown token id
        self.root = root
        self.hashes: list[bytes] = []  # chain keys of the leading committed full blocks
        self.dead = 0  # entries before it are RELEASED (sliding-window reclaim), except the first
        # `keep_first` of the group
        self.published = 0  # leading blocks handed to the prefix tier (see `newly_full`)


def check_tokens(tokens, what: str) -> tuple[int, list[int], bool]:
    """(n, token list, known) from a token-id sequence or a count."""
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        if tokens < 0:
            raise ConfigError(f"{what}: number of new tokens must be >= 0, got {tokens}")
        return tokens, [-1] * tokens, False
    try:
        toks = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)  # tensor / ndarray
    except TypeError:
        raise ConfigError(
            f"{what}: tokens must be a sequence of int token ids or a count, got "
            f"{type(tokens).__name__}"
        ) from None
    for t in toks:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= _MAX_TOKEN:
            raise ConfigError(f"{what}: token ids must be ints in [0, 2**63), got {t!r}")
    return len(toks), toks, True


class SequenceManager:
    """All sequences of one block group, sharing one `BlockPool`: the one owner of the
    sequences' records (`_Seq`: tokens, block table, committed count, chain keys). Its parts,
    each the owner of its own state, get the records they change: `keys` (`PrefixChain`: the
    namespace, chain keys, what a hit holds and costs), `growth` (`WindowedAppend`: capacity,
    window reclaim, appends, compaction), `entries` (`TableEntries`: the entries' reference
    rule, the swap records); `shape` (`GroupShape`): block size, window, kept first blocks.

    namespace: bytes mixed into every prefix key (model identity, format, layer layout), so
    caches of different models or formats can never hit each other's blocks.
    window: None, or the group's sliding window W (`reclaim` then drops blocks no query at or
    after a position can see; released keyed blocks stay cached for prefix hits, which need
    only the blocks a query after the hit sees). prefix: key committed full blocks.
    keep_first: with a window, the first blocks of every sequence are never released (sinks).
    """

    def __init__(self, pool: BlockPool, block_size: int, namespace: bytes = b"", *,
                 window: Optional[int] = None, prefix: bool = True, keep_first: int = 0):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.pool = pool
        self.shape = GroupShape(block_size, window, keep_first)
        self._seqs: dict[Hashable, _Seq] = {}
        self._ids = count()
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.entries = TableEntries(pool)  # the reference rule of entries; the swap records
        self.keys = PrefixChain(pool, self.shape, namespace, prefix)
        self.growth = WindowedAppend(pool, self.shape, self.entries)

    block_size = property(lambda self: self.shape.block_size)
    window = property(lambda self: self.shape.window)
    keep_first = property(lambda self: self.shape.keep_first)
    first_needed = calls("shape", GroupShape.first_needed)
    namespace = property(lambda self: self.keys.namespace, doc="prefix keys' namespace (`keys` owns it)")
    prefix = property(lambda self: self.keys.enabled, doc="whether committed full blocks are keyed")

    # ---- lookup ---------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(
                f"unknown sequence {seq_id!r}; {len(self._seqs)} sequences are held"
            ) from None

    def _all(self, seq_ids: Iterable[Hashable]) -> list[_Seq]:
        return [self._get(i) for i in seq_ids]

    def __contains__(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._seqs)

    def ids(self) -> list[Hashable]:
        return list(self._seqs)

    def length(self, seq_id: Hashable) -> int:
        """Tokens held (allocated) by the sequence."""
        return len(self._get(seq_id).tokens)

    def committed(self, seq_id: Hashable) -> int:
        return self._get(seq_id).committed

    def tokens(self, seq_id: Hashable) -> list[int]:
        """Copy of the token ids (-1 where only a count was given)."""
        return list(self._get(seq_id).tokens)

    def table(self, seq_id: Hashable) -> array:
        """The block table (array('i'); do not modify)."""
        return self._get(seq_id).table

    def dead(self, seq_id: Hashable) -> int:
        """Leading entries released by the window."""
        return self._get(seq_id).dead

    def min_length(self, seq_id: Hashable) -> int:
        """The fewest tokens `pop` may leave (besides 0): released blocks must stay unseen."""
        d = self._get(seq_id).dead
        return d * self.block_size + self.window - 1 if d > self.keep_first else 0

    def _new_id(self, seq_id: Optional[Hashable]) -> Hashable:
        if seq_id is None:
            seq_id = next(self._ids)
            while seq_id in self._seqs:
                seq_id = next(self._ids)
            return seq_id
        try:
            taken = seq_id in self._seqs
        except TypeError:
            raise ConfigError(f"sequence id must be hashable, got {type(seq_id).__name__}") from None
        if taken:
            raise ConfigError(f"sequence id {seq_id!r} is already in use")
        return seq_id

    def slots(self, seq_id: Hashable, start: int, n: int) -> list[int]:
        """Slots of positions start..start+n-1 (all resident; InvalidInput otherwise)."""
        s = self._get(seq_id)
        bs = self.block_size
        if n and min(s.table[start // bs:(start + n - 1) // bs + 1]) < 0:
            raise InvalidInput(f"positions [{start}, {start + n}) of sequence {seq_id!r} include "
                               "released or swapped-out blocks")
        return self.shape.slots(s.table, start, n)

    # ---- prefix keys (`prefixchain.PrefixChain`) -------------------------------------------
    chain = calls("keys", PrefixChain.chain)
    hit_span = calls("keys", PrefixChain.hit_span)
    hit_blocks = calls("keys", PrefixChain.hit_blocks)
    feasible = calls("keys", PrefixChain.feasible)
    match = calls("keys", PrefixChain.match)
    hit_cost = calls("keys", PrefixChain.hit_cost)

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Mark every allocated token of the sequences as written; key newly full blocks."""
        if isinstance(seq_ids, (list, tuple, set, frozenset)) and seq_ids not in self:
            self.keys.commit(self._all(seq_ids))
        else:
            self.keys.commit([self._get(seq_ids)])

    def newly_full(self, seq_id: Hashable) -> list[tuple[int, bytes]]:
        """(pool block, chain key) of the sequence's committed, keyed blocks not handed out
        before (`PrefixChain.newly_full`)."""
        return self.keys.newly_full(self._get(seq_id))

    # ---- appends (`growth.WindowedAppend`) --------------------------------------------------
    fits = calls("growth", WindowedAppend.fits)
    full_error = calls("growth", WindowedAppend.full_error)

    def demand(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> tuple[int, int]:
        """(blocks an append of `counts` new tokens takes, blocks its window reclaim frees):
        no change (`WindowedAppend.demand`)."""
        return self.growth.demand(self._all(seq_ids), counts)

    def reclaim(self, seq_ids: Sequence[Hashable], counts: Sequence[int]) -> None:
        """Release the blocks no query of the sequences about to grow can see any more."""
        self.growth.reclaim(self._all(seq_ids), counts)

    def extend(self, seq_ids: Sequence[Hashable], parsed: Sequence[tuple[int, list[int], bool]]
               ) -> tuple[list[int], list[tuple[int, int]]]:
        """Append already checked tokens (`check_tokens` results; capacity from `demand`):
        (slots, copies) (`WindowedAppend.extend`)."""
        return self.growth.extend(self._all(seq_ids), parsed)

    def compact(self, target: int) -> list[tuple[int, int]]:
        """Cut the pool to `target` blocks, renumbering every table (`BlockPool.compact`)."""
        return self.growth.compact(self._seqs.values(), target)

    # ---- sequences ------------------------------------------------------------------------
    def add(self, tokens: Sequence[int], salt: Salt = None, seq_id: Optional[Hashable] = None,
            *, max_hit_blocks: Optional[int] = None, rest: bool = True,
            keys: Optional[list[bytes]] = None) -> tuple[Hashable, int, list[int]]:
        """New sequence holding `tokens`, reusing cached full prefix blocks (keys: the prompt's
        `chain`, when the caller has it).

        Returns (seq_id, hit_tokens, slots): the first `hit_tokens` tokens (whole blocks, always
        fewer than len(tokens) so the model has at least one token to run; at most
        max_hit_blocks blocks; with a window only the blocks `hit_blocks` names are held, the
        others are released entries) are already stored and committed; `slots` are the slots of
        the other tokens, to be stored then committed. rest=False admits the hit tokens only
        (the others come later through a step)."""
        n, toks, _ = check_tokens(tokens, "add_sequence")
        if isinstance(tokens, int):
            raise ConfigError("add_sequence needs the prompt's token ids, not a count")
        if keys is None:
            keys = self.keys.chain(toks, salt) if self.keys.enabled else []
        root = self.keys.root(salt)
        seq_id = self._new_id(seq_id)
        bs, pool = self.block_size, self.pool
        nhit = self.keys.feasible(keys, len(keys) if max_hit_blocks is None else max_hit_blocks)
        hit_tokens = nhit * bs
        held = n if rest else hit_tokens
        held_blocks = -(-held // bs)
        cost = self.keys.hit_cost(keys, nhit, held_blocks)
        if cost and not pool.ensure(cost):
            raise CacheFull(
                f"add_sequence of {n} tokens needs {cost} blocks ({nhit} prefix hits); "
                f"{pool.headroom} available of {pool.max_blocks}"
            )
        s = _Seq(root)
        s.table.extend([RELEASED] * nhit)
        for i in self.keys.hit_blocks(nhit):
            b = pool.lookup(keys[i])
            pool.share(b)
            s.table[i] = b
        keep, lo = self.keys.hit_span(nhit)
        s.dead = lo if lo > keep else 0  # entries [keep, lo): outside the window already
        for _ in range(held_blocks - nhit):
            s.table.append(pool._take())
        s.tokens = toks[:held]
        if held > hit_tokens:
            self.growth.mark_fill(s, hit_tokens, held)
        s.committed = hit_tokens
        s.hashes = keys[:nhit]
        s.published = nhit  # a hit block is already wherever the tiers keep it
        self._seqs[seq_id] = s
        self.prefix_queries += 1
        self.prefix_query_tokens += n
        self.prefix_hit_tokens += hit_tokens
        return seq_id, hit_tokens, self.shape.slots(s.table, hit_tokens, held - hit_tokens)

    def fork(self, seq_id: Hashable, new_id: Optional[Hashable] = None) -> Hashable:
        """A new sequence sharing every block of `seq_id` (copy-on-write on the first write)."""
        s = self._get(seq_id)
        new_id = self._new_id(new_id)
        c = _Seq(s.root)
        c.tokens = list(s.tokens)
        c.table = array("i", s.table)
        c.committed, c.first_unknown, c.dead = s.committed, s.first_unknown, s.dead
        c.hashes, c.published = list(s.hashes), s.published
        for b in s.table:
            self.entries.share(b)
        self._seqs[new_id] = c
        return new_id

    def pop_needs_swap_in(self, seq_id: Hashable, n: int) -> Optional[int]:
        """The record `pop(seq_id, n)` must read back (its new partly filled last block is
        swapped out), else None. Validates n."""
        s = self._get(seq_id)
        L = len(s.tokens)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= L:
            raise ConfigError(f"pop: n must be an int in [0, {L}] for sequence {seq_id!r}, got {n!r}")
        new_len = L - n
        if new_len and new_len < self.min_length(seq_id):
            raise InvalidInput(
                f"cannot keep {new_len} tokens of sequence {seq_id!r}: its sliding-window blocks "
                f"before position {s.dead * self.block_size} were released (keep at least "
                f"{self.min_length(seq_id)}, or 0)")
        keep = -(-new_len // self.block_size)
        rid = swapped_record(s.table[keep - 1]) if new_len % self.block_size else None
        if rid is not None and self.pool.headroom < 1 and not any(
                b >= 0 and self.pool._ref[b] == 1 for b in s.table[keep:]):
            raise CacheFull(f"pop of {n} tokens from sequence {seq_id!r} must read swapped block "
                            f"{keep - 1} back and no pool block is available")
        return rid

    def pop(self, seq_id: Hashable, n: int) -> Optional[int]:
        """Roll back the last n tokens (speculative decoding, crop); frees blocks left empty.
        When the new last (partly filled) block was swapped out it is brought back into a fresh
        pool block, returned (the caller writes the record's bytes there; CacheFull first)."""
        rid = self.pop_needs_swap_in(seq_id, n)
        s = self._get(seq_id)
        new_len = len(s.tokens) - n
        keep = -(-new_len // self.block_size)
        while len(s.table) > keep:
            self.entries.drop(s.table.pop())
        back = None
        if rid is not None:
            if not self.pool.ensure(1):  # pragma: no cover - checked above
                raise CacheFull("no pool block for a swap-in")
            back = self.pool._take()
            self.entries.drop(s.table[-1])
            s.table[-1] = back
        if keep and s.table[-1] >= 0 and self.pool._ref[s.table[-1]] == 1:
            self.pool.fill[s.table[-1]] = new_len - (keep - 1) * self.block_size
            self.pool.version += 1
        del s.tokens[new_len:]
        s.committed = min(s.committed, new_len)
        if s.first_unknown >= new_len:
            s.first_unknown = _NO_UNKNOWN
        del s.hashes[new_len // self.block_size:]
        s.published = min(s.published, len(s.hashes))
        if not new_len:
            s.dead = 0
        return back

    def reset(self, seq_id: Hashable) -> None:
        """Empty a sequence (keeps its id and salt)."""
        self.pop(seq_id, self.length(seq_id))

    def free(self, seq_id: Hashable, keep_cached: bool = False) -> None:
        """Drop a sequence; its keyed blocks stay cached (LRU, tail blocks evicted first). With
        `keep_cached` (the group's `GroupSpec.keep_cached`, which `BlockManager.free` passes) the
        cached blocks its window released take their places in that order too (else they would
        go first, the prompt's first blocks first: what later hits need)."""
        s = self._get(seq_id)
        for i in range(len(s.table) - 1, -1, -1):
            if s.table[i] != RELEASED:
                self.entries.drop(s.table[i])
            elif keep_cached and i < len(s.hashes):
                self.pool.touch_key(s.hashes[i])
        del self._seqs[seq_id]

    def clear(self) -> None:
        """Drop every sequence and every cached prefix."""
        self.entries.clear()
        self._seqs.clear()
        self.pool.reset()

    # ---- swapped entries (`swapstate.TableEntries` owns the records) -------------------------
    rec_refs = property(lambda self: self.entries.refs, doc="record id -> table entries naming it")
    rec_chain = property(lambda self: self.entries.chain, doc="record id -> chain key of its block")

    def swap_candidates(self, seq_id: Hashable, cap: int) -> list[tuple[int, int, int, bool]]:
        """Entries to swap out so at most `cap` blocks of the sequence stay resident
        (`TableEntries.candidates`; then write the records and call `swapped_out`)."""
        return self.entries.candidates(self._get(seq_id), cap, self.block_size)

    def swapped_out(self, seq_id: Hashable, done: Sequence[tuple[int, int, int, bool]]) -> None:
        """The records of `done` (from `swap_candidates`) are written: swap the entries."""
        self.entries.swapped_out(self._get(seq_id), done)

    def swapped(self, seq_id: Hashable) -> list[int]:
        """Logical indices of the sequence's swapped-out blocks."""
        return [i for i, b in enumerate(self._get(seq_id).table) if b <= -2]

    def drain_dead_records(self) -> list[int]:
        """Records whose last table entry went since the last call: delete them in the tier."""
        return self.entries.drain()

    def check_invariants(self) -> None:
        """O(total) self-check (tests, debugging): AssertionError naming the first violation."""
        from .check import check_sequences

        check_sequences(self)
