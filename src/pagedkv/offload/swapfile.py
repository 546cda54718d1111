"""The disk swap tier: one preallocated-as-it-grows file of fixed-size slots, like an OS swap file.

Swap records of one cache all have the same size (same layout, fixed-width keys), and attention
reads them back one layer section at a time at every decode step: with one file per record that
is an open() per block and layer. Here every record lives in a slot of a single file opened once;
a section read is one `os.pread`, a write one `os.pwrite`.

- put: the value goes to a free slot (a slot is never rewritten while a key maps to it), and the
  key points at it only after the whole write succeeded, so a reader never sees half a block.
  A write that fails (ENOSPC, EDQUOT, any OSError) raises TierWriteError and returns the slot.
- limit_bytes: the file never grows past it (TierWriteError; swap data is never evicted).
- delete frees the slot for reuse. The file is removed by `close()`.
Values may be shorter than the slot (the first value fixes the slot size); a longer one is an
error. Private to one process (the key -> slot map lives in memory).
"""

from __future__ import annotations

import errno
import os
import re
import threading
from pathlib import Path
from typing import Optional, Union

from ..errors import ConfigError
from .tiers import Tier, TierWriteError


class SwapFileTier(Tier):
    """Fixed-size slots in one file under `root` (created)."""

    name = "swap file"

    def __init__(self, root: Union[str, os.PathLike], limit_bytes: Optional[int] = None):
        super().__init__()
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool)
                                        or limit_bytes <= 0):
            raise ConfigError(f"swap limit_bytes must be a positive int or None, got {limit_bytes!r}")
        self.root = Path(root).expanduser()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.path = self.root / "swap.bin"
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        except OSError as exc:
            raise ConfigError(f"swap directory {str(self.root)!r} is not usable: {exc}") from None
        self.name = f"swap file {self.path}"
        self.limit_bytes = limit_bytes
        self.shared: list["SwapFileTier"] = [self]  # the files limit_bytes is over (one cache)
        self.slot_bytes: Optional[int] = None
        self._slots: dict[str, tuple[int, int]] = {}  # key -> (slot, value length)
        self._free: list[int] = []
        self._next = 0  # slots ever handed out (the file holds this many)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def used_bytes(self) -> int:
        return sum(n for _, n in self._slots.values())

    # ---- reads ------------------------------------------------------------------------------
    def _read(self, key: str, start: int, length: int) -> Optional[bytes]:
        with self._lock:
            where = self._slots.get(key)
        if where is None or self._fd < 0:
            return None
        slot, n = where
        if start + length > n:
            return None
        try:
            return os.pread(self._fd, length, slot * self.slot_bytes + start)  # type: ignore[operator]
        except OSError as exc:
            self._warn_once("read", f"read of {key} failed ({exc}); treated as a miss")
            return None

    def _get(self, key: str) -> Optional[bytes]:
        with self._lock:
            where = self._slots.get(key)
        return None if where is None else self._read(key, 0, where[1])

    def _get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        return self._read(key, start, length)

    def read_ranges(self, keys: list[str], starts: list[int], length: int
                    ) -> list[Optional[bytes]]:
        """`get_range(key, start, length)` for many keys at once (the swap read-back of one
        layer): one lookup pass, then one pread each, counted once."""
        with self._lock:
            where = [self._slots.get(k) for k in keys]
            fd, slot_bytes = self._fd, self.slot_bytes
        out: list[Optional[bytes]] = []
        for w, start in zip(where, starts):
            if w is None or fd < 0 or start + length > w[1]:
                out.append(None)
                continue
            try:
                out.append(os.pread(fd, length, w[0] * slot_bytes + start))
            except OSError as exc:
                self._warn_once("read", f"read failed ({exc}); treated as a miss")
                out.append(None)
        _count_ranges(self, out, length)
        return out

    # ---- writes -----------------------------------------------------------------------------
    def _take_slot(self, size: int) -> int:
        with self._lock:
            if self.slot_bytes is None:
                self.slot_bytes = size
            if size > self.slot_bytes:
                raise TierWriteError(f"{self.name}: a value of {size} bytes does not fit its "
                                     f"{self.slot_bytes}-byte slots")
            if self._free:
                return self._free.pop()
            grown = sum(f._next * (f.slot_bytes or 0) for f in self.shared)
            if self.limit_bytes is not None and grown + self.slot_bytes > self.limit_bytes:
                others = "" if len(self.shared) == 1 else \
                    f" (with the other {len(self.shared) - 1} swap files of this cache)"
                raise TierWriteError.no_room(
                    f"{self.name}{others} is full: {grown} bytes in slots, one more slot of "
                    f"{self.slot_bytes} bytes would pass limit_bytes={self.limit_bytes} (swap data "
                    "is never evicted)")
            self._next += 1
            return self._next - 1

    def _put(self, key: str, value: bytes, if_absent: bool) -> bool:
        with self._lock:
            if if_absent and key in self._slots:
                return True
        slot = self._take_slot(len(value))
        try:
            done = 0
            view = memoryview(value)
            while done < len(value):
                done += os.pwrite(self._fd, view[done:], slot * self.slot_bytes + done)  # type: ignore[operator]
        except OSError as exc:
            with self._lock:
                self._free.append(slot)
            room = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            why = "no space left on the device (or over the disk quota)" if room else \
                exc.strerror or str(exc)
            msg = f"{self.name}: writing {key} ({len(value)} bytes) failed: {why}; nothing was stored"
            raise (TierWriteError.no_room(msg) if room else TierWriteError(msg)) from exc
        with self._lock:
            old = self._slots.get(key)
            self._slots[key] = (slot, len(value))
            if old is not None:
                self._free.append(old[0])
        return True

    def _delete(self, key: str) -> None:
        with self._lock:
            where = self._slots.pop(key, None)
            if where is not None:
                self._free.append(where[0])

    def close(self) -> None:
        """Close and delete the swap file."""
        with self._lock:
            self._slots.clear()
            self._free.clear()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        try:
            self.path.unlink()
        except OSError:
            pass


_GROUP = re.compile(r"-g(\d{3})r\d{12}$")


def _count_ranges(tier: Tier, out: list, length: int) -> None:
    """Count a `read_ranges` answer in the tier's stats."""
    with tier._lock:
        hits = sum(v is not None and len(v) == length for v in out)
        tier.stats.gets += len(out)
        tier.stats.hits += hits
        tier.stats.misses += len(out) - hits
        tier.stats.bytes_read += hits * length


class GroupedSwapFiles(Tier):
    """The disk swap tier of a cache with several block groups: one `SwapFileTier` per group
    under `root/g<N>` (a group's records all have one size, another group's another), chosen by
    the group a record key names (`SwapSpace.key_of`). limit_bytes is over all files together
    (the bytes their slots take), as it is for one file and for the memory swap tier."""

    def __init__(self, root: Union[str, os.PathLike], limit_bytes: Optional[int], groups: int):
        super().__init__()
        self.root = Path(root).expanduser()
        self.files = [SwapFileTier(self.root / f"g{g}", limit_bytes) for g in range(groups)]
        self._put_lock = threading.Lock()  # a put checks the sum over the files, then grows one
        for f in self.files:
            f.shared = self.files
        self.name = f"swap files under {self.root}"

    def _file(self, key: str) -> SwapFileTier:
        m = _GROUP.search(key)
        return self.files[int(m.group(1)) if m else 0]

    def __len__(self) -> int:
        return sum(len(f) for f in self.files)

    def _get(self, key: str) -> Optional[bytes]:
        return self._file(key)._get(key)

    def _get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        return self._file(key)._get_range(key, start, length)

    def read_ranges(self, keys: list[str], starts: list[int], length: int
                    ) -> list[Optional[bytes]]:
        """`SwapFileTier.read_ranges` (the keys of one call are of one group), counted here."""
        if not keys:
            return []
        out = self._file(keys[0]).read_ranges(keys, starts, length)
        _count_ranges(self, out, length)
        return out

    def _put(self, key: str, value: bytes, if_absent: bool) -> bool:
        with self._put_lock:
            return self._file(key)._put(key, value, if_absent)

    def _delete(self, key: str) -> None:
        self._file(key)._delete(key)

    def close(self) -> None:
        for f in self.files:
            f.close()
