"""Sequences over the block pool: block tables, prefix hits, copy-on-write, rollback.

Plain Python, no torch. A sequence is its token ids, its block table (`array('i')`, logical block
-> physical block id) and how many of its tokens are *committed* (their K/V written in every
layer). Positions map to slots as `slot(p) = table[p // block_size] * block_size + p % block_size`.

Life of a token: `allocate` hands out its slot (copying a shared, partly filled last block first:
the returned `copies` list of `(src, dst)` must be applied to every layer's pools before anything
is stored); the caller stores K/V there; `commit` marks the tokens written and keys every newly
full block in the prefix index. Only committed full blocks are ever keyed, so a prefix hit never
returns unwritten data. Tokens whose ids are unknown (`allocate(seq, n)` with a count) are stored
normally but the blocks holding them, and every later block of that sequence, are never keyed.

Every method validates first and raises (ConfigError, UnknownSequence, CacheFull) before any
state changes.
"""

from __future__ import annotations

import sys
from array import array
from itertools import count
from typing import Hashable, Iterable, Optional, Sequence, Union

from ..errors import CacheFull, ConfigError, UnknownSequence
from .hashing import Salt, chain_hash, root_hash
from .pool import BlockPool

_NO_UNKNOWN = sys.maxsize
Tokens = Union[int, Sequence[int]]


class _Seq:
    __slots__ = ("tokens", "table", "committed", "first_unknown", "root", "hashes")

    def __init__(self, root: bytes):
        self.tokens: list[int] = []  # -1 where the id is unknown
        self.table = array("i")
        self.committed = 0
        self.first_unknown = _NO_UNKNOWN  # position of the first unknown token id
        self.root = root
        self.hashes: list[bytes] = []  # chain keys of the leading committed full blocks


def _check_tokens(tokens, what: str) -> tuple[int, list[int], bool]:
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
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ConfigError(f"{what}: token ids must be non-negative ints, got {t!r}")
    return len(toks), toks, True


class SequenceManager:
    """All sequences of one cache, sharing one `BlockPool`.

    namespace: bytes mixed into every prefix key (model identity, format, layer layout), so
    caches of different models or formats can never hit each other's blocks.
    """

    def __init__(self, pool: BlockPool, block_size: int, namespace: bytes = b""):
        if not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.pool = pool
        self.block_size = block_size
        self.namespace = namespace
        self._seqs: dict[Hashable, _Seq] = {}
        self._ids = count()
        self.prefix_queries = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- lookup ---------------------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(
                f"unknown sequence {seq_id!r}; {len(self._seqs)} sequences are held"
            ) from None

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

    def _slots(self, s: _Seq, start: int, n: int) -> list[int]:
        bs, t = self.block_size, s.table
        return [t[p // bs] * bs + p % bs for p in range(start, start + n)]

    # ---- sequences ------------------------------------------------------------------------
    def add(self, tokens: Sequence[int], salt: Salt = None, seq_id: Optional[Hashable] = None
            ) -> tuple[Hashable, int, list[int]]:
        """New sequence holding `tokens`, reusing cached full prefix blocks.

        Returns (seq_id, hit_tokens, slots): the first `hit_tokens` tokens (whole blocks, always
        fewer than len(tokens) so the model has at least one token to run) are already stored
        and committed; `slots` are the slots of the other tokens, to be stored then committed.
        """
        n, toks, _ = _check_tokens(tokens, "add_sequence")
        if isinstance(tokens, int):
            raise ConfigError("add_sequence needs the prompt's token ids, not a count")
        try:
            root = root_hash(self.namespace, salt)
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        seq_id = self._new_id(seq_id)
        bs, pool = self.block_size, self.pool
        hits: list[int] = []
        hashes: list[bytes] = []
        h = root
        for i in range((n - 1) // bs if n else 0):
            h = chain_hash(h, toks[i * bs:(i + 1) * bs])
            b = pool.lookup(h)
            if b is None:
                break
            hits.append(b)
            hashes.append(h)
        n_new = -(-n // bs) - len(hits)
        revive = sum(1 for b in hits if pool.ref_count(b) == 0)
        if n_new > pool.num_available - revive:
            raise CacheFull(
                f"add_sequence of {n} tokens needs {n_new} new blocks ({len(hits)} prefix hits); "
                f"{pool.num_available - revive} available of {pool.num_blocks}"
            )
        s = _Seq(root)
        for b in hits:
            pool.share(b)
        s.table.extend(hits)
        for _ in range(n_new):
            s.table.append(pool._take())
        s.tokens = toks
        hit_tokens = len(hits) * bs
        if n > hit_tokens:
            self._mark_fill(s, hit_tokens, n)
        s.committed = hit_tokens
        s.hashes = hashes
        self._seqs[seq_id] = s
        self.prefix_queries += 1
        self.prefix_query_tokens += n
        self.prefix_hit_tokens += hit_tokens
        return seq_id, hit_tokens, self._slots(s, hit_tokens, n - hit_tokens)

    def _need(self, s: _Seq, n: int, shared: Optional[dict] = None) -> int:
        """Blocks an append of n tokens takes (new blocks + a copy of a shared last block).

        shared: in a batch, counts writers per shared last block: once all but one holder
        copied it, the last writes in place (so copies = min(writers, ref - 1))."""
        if n == 0:
            return 0
        bs = self.block_size
        L = len(s.tokens)
        need = -(-(L + n) // bs) - len(s.table)
        if L % bs:
            last = s.table[-1]
            r = self.pool._ref[last]
            if r > 1:
                if shared is None:
                    need += 1
                else:
                    c = shared.get(last, 0)
                    if c < r - 1:
                        need += 1
                    shared[last] = c + 1
        return need

    def _append(self, s: _Seq, n: int, toks: list[int], known: bool,
                copies: list[tuple[int, int]]) -> int:
        """Append (capacity already checked); returns the first new position."""
        pool, bs = self.pool, self.block_size
        L = len(s.tokens)
        if n == 0:
            return L
        if L % bs:
            last = s.table[-1]
            if pool._ref[last] > 1:  # shared, partly filled: copy before writing
                new = pool._take()
                copies.append((last, new))
                pool.record_copy(new, last)
                pool.release(last)
                s.table[-1] = new
            elif pool._hash[last] is not None:  # sole owner of a keyed block: drop the key
                pool.unregister(last)
        for _ in range(-(-(L + n) // bs) - len(s.table)):
            s.table.append(pool._take())
        s.tokens.extend(toks)
        self._mark_fill(s, L, L + n)
        if not known and s.first_unknown > L:
            s.first_unknown = L
        return L

    def _mark_fill(self, s: _Seq, start: int, end: int) -> None:
        """Record that positions start..end-1 of `s` have slots (per-block high-water mark)."""
        bs, fill, t = self.block_size, self.pool.fill, s.table
        for j in range(start // bs, (end - 1) // bs + 1):
            f = min(bs, end - j * bs)
            b = t[j]
            if fill[b] < f:
                fill[b] = f

    def allocate(self, seq_id: Hashable, tokens: Tokens) -> tuple[list[int], list[tuple[int, int]]]:
        """Slots for new tokens (ids, or a count when the ids are unknown) at the sequence end.

        Returns (slots, copies): copies are (src, dst) block pairs to copy in every layer first.
        """
        s = self._get(seq_id)
        n, toks, known = _check_tokens(tokens, "allocate")
        need = self._need(s, n)
        if need > self.pool.num_available:
            raise CacheFull(
                f"allocate of {n} tokens for sequence {seq_id!r} needs {need} blocks; "
                f"{self.pool.num_available} available of {self.pool.num_blocks}"
            )
        copies: list[tuple[int, int]] = []
        start = self._append(s, n, toks, known, copies)
        if n == 1:
            p = start
            return [s.table[p // self.block_size] * self.block_size + p % self.block_size], copies
        return self._slots(s, start, n), copies

    def allocate_batch(self, seq_ids: Sequence[Hashable], tokens: Sequence[Tokens]
                       ) -> tuple[list[int], list[tuple[int, int]]]:
        """`allocate` for several distinct sequences at once; all or nothing.

        Returns the slots concatenated in `seq_ids` order, and the block copies to apply."""
        if len(seq_ids) != len(tokens):
            raise ConfigError(
                f"allocate_batch: {len(seq_ids)} sequence ids but {len(tokens)} token lists"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise ConfigError("allocate_batch: a sequence id appears twice in the batch")
        seqs = [self._get(i) for i in seq_ids]
        parsed = [_check_tokens(t, "allocate_batch") for t in tokens]
        need = 0
        shared: dict[int, int] = {}
        for s, (n, _, _) in zip(seqs, parsed):
            need += self._need(s, n, shared)
        if need > self.pool.num_available:
            raise CacheFull(
                f"allocate_batch of {sum(p[0] for p in parsed)} tokens over {len(seqs)} "
                f"sequences needs {need} blocks; {self.pool.num_available} available of "
                f"{self.pool.num_blocks}"
            )
        copies: list[tuple[int, int]] = []
        slots: list[int] = []
        bs = self.block_size
        for s, (n, toks, known) in zip(seqs, parsed):
            start = self._append(s, n, toks, known, copies)
            if n == 1:
                slots.append(s.table[start // bs] * bs + start % bs)
            else:
                slots.extend(self._slots(s, start, n))
        return slots, copies

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Mark every allocated token of the sequences as written; key newly full blocks."""
        if isinstance(seq_ids, (list, tuple, set, frozenset)) and seq_ids not in self:
            ids = list(seq_ids)
        else:
            ids = [seq_ids]
        seqs = [self._get(i) for i in ids]
        bs, pool = self.block_size, self.pool
        for s in seqs:
            s.committed = len(s.tokens)
            full = min(s.committed, s.first_unknown) // bs
            h = s.hashes[-1] if s.hashes else s.root
            for i in range(len(s.hashes), full):
                h = chain_hash(h, s.tokens[i * bs:(i + 1) * bs])
                s.hashes.append(h)
                pool.register(s.table[i], h)

    def fork(self, seq_id: Hashable, new_id: Optional[Hashable] = None) -> Hashable:
        """A new sequence sharing every block of `seq_id` (copy-on-write on the first write)."""
        s = self._get(seq_id)
        new_id = self._new_id(new_id)
        c = _Seq(s.root)
        c.tokens = list(s.tokens)
        c.table = array("i", s.table)
        c.committed = s.committed
        c.first_unknown = s.first_unknown
        c.hashes = list(s.hashes)
        for b in s.table:
            self.pool.share(b)
        self._seqs[new_id] = c
        return new_id

    def pop(self, seq_id: Hashable, n: int) -> None:
        """Roll back the last n tokens (speculative decoding); frees blocks left empty."""
        s = self._get(seq_id)
        L = len(s.tokens)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= L:
            raise ConfigError(f"pop: n must be an int in [0, {L}] for sequence {seq_id!r}, got {n!r}")
        new_len = L - n
        keep = -(-new_len // self.block_size)
        while len(s.table) > keep:
            self.pool.release(s.table.pop())
        if keep and self.pool._ref[s.table[-1]] == 1:
            self.pool.fill[s.table[-1]] = new_len - (keep - 1) * self.block_size
            self.pool.version += 1
        del s.tokens[new_len:]
        s.committed = min(s.committed, new_len)
        if s.first_unknown >= new_len:
            s.first_unknown = _NO_UNKNOWN
        del s.hashes[new_len // self.block_size:]

    def reset(self, seq_id: Hashable) -> None:
        """Empty a sequence (keeps its id and salt)."""
        self.pop(seq_id, self.length(seq_id))

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; its keyed blocks stay cached (LRU, tail blocks evicted first)."""
        s = self._get(seq_id)
        for b in reversed(s.table):
            self.pool.release(b)
        del self._seqs[seq_id]

    def clear(self) -> None:
        """Drop every sequence and every cached prefix."""
        self._seqs.clear()
        self.pool.reset()

    # ---- checking -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """O(total) self-check (tests, debugging): AssertionError naming the first violation."""
        pool, bs = self.pool, self.block_size
        refs = [0] * pool.num_blocks
        for sid, s in self._seqs.items():
            assert len(s.table) == -(-len(s.tokens) // bs), f"{sid!r}: table length"
            assert s.committed <= len(s.tokens), f"{sid!r}: committed > length"
            for b in s.table:
                refs[b] += 1
            h = s.root
            for i in range(len(s.tokens) // bs):
                if i * bs + bs > min(s.committed, s.first_unknown):
                    break
                h = chain_hash(h, s.tokens[i * bs:(i + 1) * bs])
                if i < len(s.hashes):
                    assert s.hashes[i] == h, f"{sid!r}: stale chain key of block {i}"
                bh = pool.block_hash(s.table[i])
                assert bh is None or bh == h, f"{sid!r}: block {s.table[i]} keyed for other data"
            if len(s.tokens) % bs and len(s.tokens) // bs < len(s.table):
                pass  # a keyed partly-owned last block is legal (copied/unkeyed before writes)
        free, cached = set(pool._free), set(pool._cached)
        assert len(free) == len(pool._free), "block twice on the free list"
        assert not free & cached, "block both free and cached"
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
