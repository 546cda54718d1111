"""The disk tier: one file per value under a directory, with a size limit and LRU eviction.

Files live at `root/<first two key chars>/<key>`; a write goes to a temporary file in
`root/.tmp/` and is moved into place with `os.replace`, so a reader sees the whole old value, the
whole new value, or nothing -- never half a block. A write that fails (ENOSPC, EDQUOT, any
OSError) removes its temporary file and raises `TierWriteError`; the index is only updated after
a successful rename, so the tier (and whatever cache uses it) stays consistent.

Size limit: `limit_bytes` counts value bytes. With `evict=True` (the prefix store) the least
recently used files are deleted to make room; with `evict=False` (a store whose data must
never be dropped) a write beyond the limit raises `TierWriteError` instead. Recency is tracked in
this process and mirrored in file mtimes (touched on a hit), so another process opening the same
directory starts from a sensible LRU order. Several processes may share a directory: values are
immutable and renames atomic; each process enforces the limit on what it knows of.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Optional, Union

from ..errors import ConfigError
from .tiers import Tier, TierWriteError

_TMP = ".tmp"
_STALE_TMP_S = 3600.0


class DiskTier(Tier):
    """File-backed tier.

    root: directory (created). limit_bytes: None = unbounded. evict: LRU-evict to make room
    (True) or refuse writes over the limit (False). fsync: fsync each file before the rename
    (durable across power loss; slower).
    """

    name = "disk"

    def __init__(self, root: Union[str, os.PathLike], limit_bytes: Optional[int] = None, *,
                 evict: bool = True, fsync: bool = False):
        super().__init__()
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool)
                                        or limit_bytes <= 0):
            raise ConfigError(f"disk tier limit_bytes must be a positive int or None, got {limit_bytes!r}")
        self.root = Path(root).expanduser()
        try:
            (self.root / _TMP).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"disk tier directory {str(self.root)!r} cannot be created: {exc}") from None
        self.name = f"disk tier {self.root}"
        self.limit_bytes = limit_bytes
        self.evict = evict
        self.fsync = fsync
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._used = 0
        self._scan()

    # ---- index ------------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        now = time.time()
        for sub in self.root.iterdir():
            if sub.name == _TMP:
                for t in sub.iterdir():
                    try:
                        if now - t.stat().st_mtime > _STALE_TMP_S:
                            t.unlink()
                    except OSError:
                        pass
                continue
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for f in sub.iterdir():
                try:
                    st = f.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, f.name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self._used += size

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key

    def _forget(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._used -= size

    def _touch(self, key: str, size: int) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self._used += size
        try:
            os.utime(self._path(key))
        except OSError:
            pass

    # ---- reads ------------------------------------------------------------------------------
    def _get(self, key: str) -> Optional[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        except OSError as exc:
            self._warn_once("read", f"read of {key} failed ({exc}); treated as a miss")
            return None
        self._touch(key, len(data))
        return data

    def _get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                data = f.read(length)
        except FileNotFoundError:
            with self._lock:
                self._forget(key)
            return None
        except OSError as exc:
            self._warn_once("read", f"read of {key} failed ({exc}); treated as a miss")
            return None
        return data

    # ---- writes -----------------------------------------------------------------------------
    def _make_room(self, key: str, size: int) -> None:
        """Evict (or refuse) so that `size` more bytes fit; called with the lock held."""
        if self.limit_bytes is None:
            return
        if size > self.limit_bytes:
            raise TierWriteError(
                f"{self.name}: a value of {size} bytes is larger than the whole tier "
                f"(limit_bytes={self.limit_bytes})"
            )
        need = self._used - self._index.get(key, 0) + size - self.limit_bytes
        if need <= 0:
            return
        if not self.evict:
            raise TierWriteError(
                f"{self.name} is full: {size} more bytes exceed limit_bytes={self.limit_bytes} "
                f"({self._used} used; this tier never evicts)"
            )
        for victim in list(self._index):
            if need <= 0:
                break
            if victim == key:
                continue
            vsize = self._index[victim]
            try:
                self._path(victim).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            self._forget(victim)
            self.stats.evictions += 1
            need -= vsize

    def _put(self, key: str, value: bytes, if_absent: bool) -> bool:
        path = self._path(key)
        if if_absent and path.exists():
            self._touch(key, len(value))
            return True
        with self._lock:
            self._make_room(key, len(value))
        tmp = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=key[:16] + ".", dir=self.root / _TMP)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                why = "no space left on the device (or over the disk quota)"
            else:
                why = exc.strerror or str(exc)
            raise TierWriteError(
                f"{self.name}: writing {key} ({len(value)} bytes) failed: {why}; nothing was "
                "stored"
            ) from exc
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        with self._lock:
            self._forget(key)
            self._index[key] = len(value)
            self._used += len(value)
        return True

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError:
            return
        with self._lock:
            self._forget(key)

    def clear(self) -> None:
        """Delete every value this tier knows of."""
        for key in list(self._index):
            self._delete(key)
