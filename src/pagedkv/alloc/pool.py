"""The block pool: ids, reference counts, free list, prefix index and LRU of cached blocks.

Plain Python, no torch; every operation is O(1) (allocate(n) is O(n)).

Each block id is in exactly one of three places:
- **free** (ref 0, no hash): on the free list (a stack; block 0 comes out first);
- **used** (ref > 0): held by one or more sequences (possibly also keyed in the prefix index);
- **cached** (ref 0, hashed): its contents are a known prefix block; kept in LRU order and
  reclaimed (evicted, key dropped) only when the free list is empty and a block is needed.
`num_free + num_used + num_cached == num_blocks` always.

The prefix index maps a chain hash (see `hashing.py`) to one block. A hashed block is immutable:
the sequence layer either unregisters it (sole owner) or copies it (shared) before writing.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Optional

from ..errors import CacheFull, ConfigError
from .trace import BlockTrace


class BlockPool:
    """Hands out block ids `0 .. num_blocks-1` and counts references to them.

    in_use: bytearray [num_blocks], 1 where ref > 0; fill: array('i') [num_blocks], how many
    leading slots of each used block have been handed out (the most any holder has); keyed:
    bytearray [num_blocks], 1 where the block is keyed (its contents are frozen). Cheap mirrors
    the cache uses to validate slot mappings without walking Python lists.
    """

    def __init__(self, num_blocks: int, *, trace: bool = False, max_blocks: Optional[int] = None):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < num_blocks):
            raise ConfigError(f"max_blocks must be None or an int >= num_blocks ({num_blocks}), "
                              f"got {max_blocks!r}")
        self.num_blocks = num_blocks
        self.max_blocks = num_blocks if max_blocks is None else max_blocks  # growth limit
        self._ref = [0] * num_blocks
        self._hash: list[Optional[bytes]] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._index: dict[bytes, int] = {}
        self.in_use = bytearray(num_blocks)
        self.fill = array("i", [0]) * num_blocks  # slots handed out per block (max over holders)
        self.keyed = bytearray(num_blocks)  # 1 where the block is in the prefix index (read-only)
        self.trace: Optional[BlockTrace] = BlockTrace() if trace else None
        self.evictions = 0
        self.version = 0  # bumped whenever a handed-out slot may stop being valid

    # ---- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks on the free list (no data anyone can find)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for prefix hits (evictable)."""
        return len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks with ref > 0."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free + cached."""
        return len(self._free) + len(self._cached)

    @property
    def headroom(self) -> int:
        """Blocks an allocation can get: available now plus what the pool may still grow by."""
        return len(self._free) + len(self._cached) + self.max_blocks - self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> Optional[bytes]:
        """The prefix key a block is registered under, or None."""
        return self._hash[block]

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def free_blocks(self) -> list[int]:
        """Copy of the free list (tests, debugging)."""
        return list(self._free)

    def cached_blocks(self) -> list[int]:
        """Cached blocks, least recently used first."""
        return list(self._cached)

    def index_size(self) -> int:
        return len(self._index)

    # ---- allocation -----------------------------------------------------------------------
    # ---- size ---------------------------------------------------------------------------------
    def grow(self, new_total: int) -> None:
        """More block ids `num_blocks .. new_total-1`, free (handed out after the current free
        list, lowest first). The cache resizes its pools to `num_blocks` before storing."""
        if not isinstance(new_total, int) or not self.num_blocks <= new_total <= self.max_blocks:
            raise ConfigError(f"grow to {new_total!r} blocks: must be in [{self.num_blocks}, "
                              f"{self.max_blocks}]")
        extra = new_total - self.num_blocks
        if not extra:
            return
        self._ref += [0] * extra
        self._hash += [None] * extra
        self._free = list(range(new_total - 1, self.num_blocks - 1, -1)) + self._free
        self.in_use = self.in_use + bytearray(extra)  # new objects: no live buffer views
        self.keyed = self.keyed + bytearray(extra)
        self.fill = self.fill + array("i", [0]) * extra
        self.num_blocks = new_total

    def ensure(self, n: int) -> bool:
        """Grow (doubling, capped at max_blocks) until n blocks are available; False when even
        max_blocks is not enough (nothing changed)."""
        avail = len(self._free) + len(self._cached)
        if n <= avail:
            return True
        if n > self.headroom:
            return False
        self.grow(min(max(2 * self.num_blocks, self.num_blocks + n - avail), self.max_blocks))
        return True

    def compact(self, target: int) -> list[tuple[int, int]]:
        """Renumber every held block with id >= target to a free id < target, and as many
        cached ones as then fit (the others are evicted, least recently used first), and cut the
        pool to `target` blocks. Returns the (src, dst) moves: the caller renumbers its tables
        and moves the data, then cuts its pools. Raises ConfigError if the held ones do not fit."""
        held = [b for b in range(target, self.num_blocks) if self._ref[b]]
        low = [b for b in self._cached if b < target]  # least recently used first
        spare = [b for b in range(target) if not self._ref[b] and b not in self._cached]
        if not 0 < target <= self.num_blocks or len(held) > len(spare) + len(low):
            raise ConfigError(f"cannot compact {self.num_blocks} blocks to {target}")
        for b in low[:max(0, len(held) - len(spare))]:  # make room for the held blocks
            self._evict(b)
        spare = [b for b in range(target) if not self._ref[b] and b not in self._cached]
        high = [b for b in self._cached if b >= target]
        for b in high[:max(0, len(high) - (len(spare) - len(held)))]:
            self._evict(b)
        live = held + [b for b in self._cached if b >= target]
        moves = list(zip(live, spare))
        for src, dst in moves:
            self._ref[dst], self._hash[dst] = self._ref[src], self._hash[src]
            self.in_use[dst], self.keyed[dst], self.fill[dst] = \
                self.in_use[src], self.keyed[src], self.fill[src]
            if self._hash[dst] is not None:
                self._index[self._hash[dst]] = dst
            if src in self._cached:
                self._cached = OrderedDict((dst if b == src else b, None) for b in self._cached)
        self._free = [b for b in range(target - 1, -1, -1)
                      if not self._ref[b] and b not in self._cached]
        del self._ref[target:], self._hash[target:]
        self.in_use = self.in_use[:target]
        self.keyed = self.keyed[:target]
        self.fill = self.fill[:target]
        self.num_blocks = target
        self.max_blocks = max(self.max_blocks, target)
        self.version += 1
        return moves

    def _evict(self, b: int) -> None:
        """Drop cached block b's key (it leaves the LRU; the caller places the id)."""
        del self._cached[b]
        h = self._hash[b]
        self._hash[b] = None
        self.keyed[b] = 0
        if self._index.get(h) == b:
            del self._index[h]
        self.evictions += 1
        if self.trace is not None:
            self.trace.add("evict", b, 0)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref 1: from the free list, then by evicting the LRU cached blocks.

        Raises CacheFull (nothing changed) when fewer than n blocks are available."""
        if n > len(self._free) + len(self._cached):
            raise CacheFull(
                f"need {n} blocks, {len(self._free)} free + {len(self._cached)} cached "
                f"of {self.num_blocks}"
            )
        return [self._take() for _ in range(n)]

    def allocate_one(self) -> int:
        """One fresh block with ref 1 (CacheFull if none is available)."""
        if not self._free and not self._cached:
            raise CacheFull(f"need 1 block, 0 free + 0 cached of {self.num_blocks}")
        return self._take()

    def _take(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b = next(iter(self._cached))
            self._evict(b)
        self._ref[b] = 1
        self.in_use[b] = 1
        self.fill[b] = 0
        if self.trace is not None:
            self.trace.add("alloc", b, 1)
        return b

    def share(self, block: int) -> None:
        """One more reference to `block` (a cached block is revived out of the LRU)."""
        r = self._ref[block]
        if r == 0:
            if block not in self._cached:
                raise AssertionError(f"share of free block {block}")
            del self._cached[block]
            self.in_use[block] = 1
        self._ref[block] = r + 1
        if self.trace is not None:
            self.trace.add("share", block, r + 1)

    def release(self, block: int) -> None:
        """Drop one reference; at zero the block is cached (if hashed) or freed."""
        r = self._ref[block] - 1
        assert r >= 0, f"release of unreferenced block {block}"
        self._ref[block] = r
        if r == 0:
            self.version += 1
            self.in_use[block] = 0
            if self._hash[block] is not None:
                self._cached[block] = None
            else:
                self._free.append(block)
        if self.trace is not None:
            self.trace.add("free", block, r)

    def touch_key(self, key: bytes) -> None:
        """Make the cached block registered under `key` the most recently used (evicted last);
        nothing when no block is registered or it is not cached."""
        block = self.lookup(key)
        if block is not None and block in self._cached:
            self._cached.move_to_end(block)

    # ---- prefix index ---------------------------------------------------------------------
    def lookup(self, key: bytes) -> Optional[int]:
        """The block registered under `key`, or None."""
        return self._index.get(key)

    def register(self, block: int, key: bytes) -> bool:
        """Key a used block's (fully written) contents. False if the key or block is taken."""
        if self._hash[block] is not None or key in self._index:
            return False
        assert self._ref[block] > 0, f"register of unreferenced block {block}"
        self._hash[block] = key
        self.keyed[block] = 1
        self.version += 1  # its slots are no longer writable
        self._index[key] = block
        if self.trace is not None:
            self.trace.add("cache", block, self._ref[block])
        return True

    def unregister(self, block: int) -> None:
        """Drop a used block's key (its owner is about to overwrite it)."""
        h = self._hash[block]
        if h is None:
            return
        assert self._ref[block] > 0, f"unregister of unreferenced block {block}"
        self._hash[block] = None
        self.keyed[block] = 0
        if self._index.get(h) == block:
            del self._index[h]
        if self.trace is not None:
            self.trace.add("uncache", block, self._ref[block])

    def reset_prefix_cache(self) -> int:
        """Forget every key; cached blocks go back to the free list. Returns how many did."""
        n = len(self._cached)
        for b in self._cached:
            self._hash[b] = None
            self.keyed[b] = 0
            self._free.append(b)
            if self.trace is not None:
                self.trace.add("evict", b, 0)
        self._cached.clear()
        for b in self._index.values():
            self._hash[b] = None
            self.keyed[b] = 0
        self._index.clear()
        return n

    def record_copy(self, dst: int, src: int) -> None:
        """Trace a copy-on-write (the data copy itself is the cache's job)."""
        if self.trace is not None:
            self.trace.add("copy", dst, self._ref[dst], src)

    def reset(self) -> None:
        """Everything free, no keys (all holders must have been dropped by the caller)."""
        n = self.num_blocks
        self._ref = [0] * n
        self._hash = [None] * n
        self._free = list(range(n - 1, -1, -1))
        self._cached.clear()
        self._index.clear()
        self.version += 1
        self.in_use[:] = bytes(n)  # in place: views of it stay valid
        self.keyed[:] = bytes(n)
        for b in range(n):
            self.fill[b] = 0
