"""The storage tiers below memory share one small interface: bytes in, bytes (or a miss) out.

A tier maps string keys (`[0-9A-Za-z_.-]`, at most 200 characters, starting with a letter, digit
or `_`, so a key can never name `.`, `..` or a hidden file) to immutable byte values:
- `get(key, size=None)` -> bytes or None (a miss: absent, or the tier is unreachable). With
  `size` (what the caller expects), a value of any other length, or one that is not a plain
  value (a FIFO or device on disk, another Redis type), is returned as `b""` (present but
  unusable, so the caller can repair it) without being read: at most `size` bytes are read;
- `get_many(keys, size=None)` -> a list of the above (one round trip on a remote tier);
- `get_bounded(key, limit)` -> the value when at most `limit` bytes (a side record whose exact
  size is not known in advance), `b""` for a longer or unusable one (at most `limit` bytes are
  read), None when absent;
- `get_range(key, start, length)` -> exactly `length` bytes or None;
- `put_many(items)`: several puts (one round trip on a remote tier);
- `put(key, value)`: atomic (a reader never sees half a value). A failure that the caller must
  know about (disk full, value over the size limit) raises `TierWriteError` with nothing
  written; a remote tier that is down or out of memory counts the failure and warns once;
- `delete(key)`, `close()`.
Tiers never interpret the bytes: integrity is the record's job (`record.py`).
`stats` counts hits, misses, bytes and failures for benchmarks and reports.
"""

from __future__ import annotations

import re
import threading
import warnings
from dataclasses import dataclass, fields
from typing import Optional

from ..errors import ConfigError, PagedKVError

_KEY = re.compile(r"^[0-9A-Za-z_][0-9A-Za-z_.\-]{0,199}$")


class TierWriteError(PagedKVError, OSError):
    """A value could not be stored (disk full, over the tier's size limit, read-only, permission
    denied); nothing was written. `full`: True when the tier lacks room (a later write may
    fit), False when it cannot be written at all."""

    full = False

    @classmethod
    def no_room(cls, message: str) -> "TierWriteError":
        err = cls(message)
        err.full = True
        return err


class SwapLost(PagedKVError):
    """A swapped-out block could not be read back intact (its file was removed or corrupted).

    `keys`: the swap records concerned (internal names; the cache turns them into the sequences
    and blocks they hold before the error reaches the caller)."""

    def __init__(self, message: str, keys: tuple = ()):
        super().__init__(message)
        self.keys = tuple(keys)


class TierWarning(UserWarning):
    """A tier is unreachable, slow or full: its reads are misses until it recovers."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):  # match: "key\n" passed
        raise ConfigError("tier key must be 1-200 characters of [0-9A-Za-z_.-] starting with a "
                          f"letter, digit or '_', got {key!r}")
    return key


def _check_size(size: Optional[int]) -> None:
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ConfigError(f"expected value size must be a positive int or None, got {size!r}")


@dataclass
class TierStats:
    """Counters of one tier (mutable; read with `snapshot()`)."""

    gets: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    faults: int = 0  # reads or writes that failed because the tier was down / slow / full

    def snapshot(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Tier:
    """Base class: subclasses implement `_get`, `_get_range`, `_put`, `_delete`."""

    name = "tier"
    remote = False  # True when a request costs a network round trip (batch lookups then)

    def __init__(self) -> None:
        self.stats = TierStats()
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        # called with [(key, bytes)] when writes counted as failed turn out stored (a remote
        # tier learns it once the server answers again)
        self.settled: list = []

    # ---- public, counted --------------------------------------------------------------------
    def get(self, key: str, size: Optional[int] = None) -> Optional[bytes]:
        """The value, None (a miss), or with `size` b"" for a value that is not `size` bytes."""
        check_key(key)
        _check_size(size)
        v = self._get(key) if size is None else self._get_sized(key, size)
        self._count_read(v)
        return v

    def get_many(self, keys: list[str], size: Optional[int] = None) -> list[Optional[bytes]]:
        """`get` of several keys (one round trip on a remote tier)."""
        for key in keys:
            check_key(key)
        _check_size(size)
        vals = self._get_many(keys, size)
        for v in vals:
            self._count_read(v)
        return vals

    def get_bounded(self, key: str, limit: int) -> Optional[bytes]:
        """The value if it is at most `limit` bytes, b"" if longer or unusable (never read
        past `limit`), None when absent."""
        check_key(key)
        _check_size(limit)
        v = self._get_bounded(key, limit)
        self._count_read(v)
        return v

    def get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        check_key(key)
        if start < 0 or length < 0:
            raise ConfigError(f"get_range needs start, length >= 0, got {start}, {length}")
        v = self._get_range(key, start, length)
        if v is not None and len(v) != length:
            v = None  # short value: truncated entry
        self._count_read(v)
        return v

    def put(self, key: str, value: bytes, if_absent: bool = False) -> bool:
        """Store `value`; True when stored (or, with if_absent, already there), False when a
        remote tier skipped it (down or full; warned once)."""
        check_key(key)
        try:
            ok = self._put(key, bytes(value) if not isinstance(value, bytes) else value, if_absent)
        except TierWriteError:
            with self._lock:
                self.stats.put_failures += 1
            raise
        with self._lock:
            if ok:
                self.stats.puts += 1
                self.stats.bytes_written += len(value)
            else:
                self.stats.put_failures += 1
        return ok

    def put_many(self, items: list[tuple[str, bytes]], if_absent: bool = False) -> list[bool]:
        """`put` of several values (one round trip on a remote tier); per item stored or not.
        A local tier raises TierWriteError at the first failed write (earlier ones stay)."""
        for key, _ in items:
            check_key(key)
        res = self._put_many(items, if_absent)
        with self._lock:
            for (_, v), ok in zip(items, res):
                if ok:
                    self.stats.puts += 1
                    self.stats.bytes_written += len(v)
                else:
                    self.stats.put_failures += 1
        return res

    def delete(self, key: str) -> None:
        check_key(key)
        self._delete(key)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------------
    def _count_read(self, v: Optional[bytes]) -> None:
        with self._lock:
            self.stats.gets += 1
            if not v:  # absent, or present but unusable (b"")
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(v)

    def _warn_once(self, kind: str, message: str) -> None:
        """One TierWarning per kind of fault until `_recovered(kind)`."""
        with self._lock:
            self.stats.faults += 1
            first = kind not in self._warned
            self._warned.add(kind)
        if first:  # name the tier once (a TierWriteError's message already starts with it)
            text = message if message.startswith(self.name) else f"{self.name}: {message}"
            warnings.warn(text, TierWarning, stacklevel=4)

    def _recovered(self, kind: str) -> None:
        self._warned.discard(kind)

    # ---- to implement -----------------------------------------------------------------------
    def _get(self, key: str) -> Optional[bytes]:
        raise NotImplementedError

    def _get_sized(self, key: str, size: int) -> Optional[bytes]:
        """Override to read at most `size` bytes (this default fetches the whole value)."""
        v = self._get(key)
        return v if v is None or len(v) == size else b""

    def _get_bounded(self, key: str, limit: int) -> Optional[bytes]:
        """Override to read at most `limit` bytes (this default fetches the whole value)."""
        v = self._get(key)
        return v if v is None or len(v) <= limit else b""

    def _get_many(self, keys: list[str], size: Optional[int]) -> list[Optional[bytes]]:
        if size is None:
            return [self._get(k) for k in keys]
        return [self._get_sized(k, size) for k in keys]

    def _get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        v = self._get(key)
        return None if v is None else v[start:start + length]

    def _put(self, key: str, value: bytes, if_absent: bool) -> bool:
        raise NotImplementedError

    def _put_many(self, items: list[tuple[str, bytes]], if_absent: bool) -> list[bool]:
        out = []
        for key, value in items:
            try:
                out.append(self._put(key, value, if_absent))
            except TierWriteError:
                with self._lock:
                    self.stats.put_failures += 1
                    for (_, v), ok in zip(items, out):
                        self.stats.puts += ok
                        self.stats.bytes_written += len(v) if ok else 0
                raise
        return out

    def _delete(self, key: str) -> None:
        raise NotImplementedError


class MemoryTier(Tier):
    """A dict in this process (tests, benchmarks, and a swap tier when disk is not wanted).

    limit_bytes: None for unbounded, else puts beyond it raise TierWriteError (no eviction:
    a swap tier must never drop data)."""

    name = "memory"

    def __init__(self, limit_bytes: Optional[int] = None):
        super().__init__()
        self.limit_bytes = limit_bytes
        self._data: dict[str, bytes] = {}
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    def _get(self, key):
        return self._data.get(key)

    def _put(self, key, value, if_absent):
        if if_absent and key in self._data:
            return True
        old = len(self._data.get(key, b""))
        if self.limit_bytes is not None and self._used - old + len(value) > self.limit_bytes:
            raise TierWriteError.no_room(
                f"memory tier full: {len(value)} more bytes would exceed its limit of "
                f"{self.limit_bytes} ({self._used} used)"
            )
        self._data[key] = value
        self._used += len(value) - old
        return True

    def _delete(self, key):
        v = self._data.pop(key, None)
        if v is not None:
            self._used -= len(v)

    def keys(self) -> list[str]:
        return list(self._data)
