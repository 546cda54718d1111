"""The disk tier: one file per value under a directory, with a size limit and LRU eviction.

Files live at `root/<fan>/<key>`, `<fan>` two hex digits of a hash of the key (256
subdirectories, whatever the keys look like); a write goes to a temporary file in `root/.tmp/`
and is moved into place with `os.replace`, so a reader sees the whole old value, the whole new
value, or nothing -- never half a block. A write that fails (ENOSPC, EDQUOT, any OSError) removes
its temporary file and raises `TierWriteError`; the index is only updated after a successful
rename, so the tier (and whatever cache uses it) stays consistent.

Reads treat the directory as untrusted: a value is opened non-blocking without following a
symlink, must be a regular file (a FIFO or device placed there is never read, so it cannot hang
the caller), and with an expected size (`get(key, size)`) a file of any other length is
reported unusable without being read; at most that many bytes are ever read.

Size limit: `limit_bytes` counts value bytes. With `evict=True` (the prefix store) the least
recently used files are deleted to make room; with `evict=False` (a store whose data must
never be dropped) a write beyond the limit raises `TierWriteError` instead. Recency is tracked in
this process and mirrored in file mtimes (touched on a hit), so another process opening the same
directory starts from a sensible LRU order. The directory is scanned once per process, at the
first write that needs the index (a reader never scans); every tier on the same directory in
this process shares that index. Several processes may share a directory: values are immutable
and renames atomic; each process enforces the limit on what it knows of.

A directory that exists but cannot be written (a read-only mount, another user's store) opens
read-only: reads work, writes raise `TierWriteError` naming why.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import threading
import time
import weakref
from collections import OrderedDict
from hashlib import blake2b
from pathlib import Path
from typing import Optional, Union

from ..errors import ConfigError
from .tiers import Tier, TierWriteError

_TMP = ".tmp"
_STALE_TMP_S = 3600.0
_HEX = frozenset("0123456789abcdef")
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def fan_out(key: str) -> str:
    """The subdirectory of `key`: two hex digits of its hash (uniform over 256 directories)."""
    return blake2b(key.encode(), digest_size=1).hexdigest()


class _Index:
    """What one process knows of a directory's files: key -> size, least recently used first.
    Shared by every DiskTier on that directory in the process; filled by one scan, lazily."""

    def __init__(self) -> None:
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.used = 0
        self.scanned = False
        self.lock = threading.RLock()

    def forget(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used -= size

    def add(self, key: str, size: int) -> None:
        self.forget(key)
        self.sizes[key] = size
        self.used += size


_INDEXES: "weakref.WeakValueDictionary[tuple, _Index]" = weakref.WeakValueDictionary()
_INDEXES_LOCK = threading.Lock()


def _shared_index(root: Path) -> _Index:
    st = root.stat()
    where = (os.path.realpath(root), st.st_dev, st.st_ino)
    with _INDEXES_LOCK:
        idx = _INDEXES.get(where)
        if idx is None:
            idx = _Index()
            _INDEXES[where] = idx
        return idx


class DiskTier(Tier):
    """File-backed tier.

    root: directory (created). limit_bytes: None = unbounded. evict: LRU-evict to make room
    (True) or refuse writes over the limit (False). fsync: fsync each file before the rename
    (durable across power loss; slower). `read_only` is True when the directory cannot be
    written (then every write raises TierWriteError).
    """

    name = "disk"

    def __init__(self, root: Union[str, os.PathLike], limit_bytes: Optional[int] = None, *,
                 evict: bool = True, fsync: bool = False):
        super().__init__()
        if limit_bytes is not None and (not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool)
                                        or limit_bytes <= 0):
            raise ConfigError(f"disk tier limit_bytes must be a positive int or None, got {limit_bytes!r}")
        self.root = Path(root).expanduser()
        self.read_only = False
        self._why_read_only = ""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # private when new
            (self.root / _TMP).mkdir(mode=0o700, exist_ok=True)
            if not os.access(self.root / _TMP, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "permission denied", str(self.root / _TMP))
        except OSError as exc:
            if not self.root.is_dir():
                raise ConfigError(
                    f"disk tier directory {str(self.root)!r} cannot be created: {exc}") from None
            self.read_only = True
            self._why_read_only = exc.strerror or str(exc)
        self.name = f"disk tier {self.root}"
        self.limit_bytes = limit_bytes
        self.evict = evict
        self.fsync = fsync
        self._idx = _shared_index(self.root)

    # ---- index ------------------------------------------------------------------------------
    def _ensure_scanned(self) -> None:
        """Index the directory's files once per process (oldest mtime first); called with the
        index lock held. Removes stale temporaries and files of the old `pk/`-style layout."""
        idx = self._idx
        if idx.scanned:
            return
        idx.scanned = True
        found = []
        now = time.time()
        try:
            subs = list(os.scandir(self.root))
        except OSError:
            return
        for sub in subs:
            if sub.name == _TMP:
                if not self.read_only:
                    self._remove_stale_tmp(sub.path, now)
                continue
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            stale_layout = not set(sub.name) <= _HEX
            try:
                entries = list(os.scandir(sub.path))
            except OSError:
                continue
            for f in entries:
                if stale_layout or fan_out(f.name) != sub.name:
                    if not self.read_only:  # unreachable by any key: free its space
                        _unlink_quietly(f.path)
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, f.name, st.st_size))
        known = dict(idx.sizes)  # touched or written before the scan: most recent
        idx.sizes.clear()
        idx.used = 0
        for _, name, size in sorted(found):
            if name not in known:
                idx.add(name, size)
        for name, size in known.items():
            idx.add(name, size)

    @staticmethod
    def _remove_stale_tmp(path: str, now: float) -> None:
        try:
            for t in os.scandir(path):
                try:
                    if now - t.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                        os.unlink(t.path)
                except OSError:
                    pass
        except OSError:
            pass

    @property
    def used_bytes(self) -> int:
        with self._idx.lock:
            self._ensure_scanned()
            return self._idx.used

    def __len__(self) -> int:
        with self._idx.lock:
            self._ensure_scanned()
            return len(self._idx.sizes)

    def _path(self, key: str) -> Path:
        return self.root / fan_out(key) / key

    def _touch(self, key: str, size: int) -> None:
        with self._idx.lock:
            if key in self._idx.sizes:
                self._idx.sizes.move_to_end(key)
            else:
                self._idx.add(key, size)
        if not self.read_only:
            try:
                os.utime(self._path(key))
            except OSError:
                pass

    # ---- reads ------------------------------------------------------------------------------
    def _read(self, key: str, start: int, length: Optional[int], exact: Optional[int],
              most: Optional[int] = None) -> Optional[bytes]:
        """Bytes [start, start+length) (length None: to the end) of key's file, None if absent,
        b"" if it is not a regular file, (with `exact`) not exactly `exact` bytes long or (with
        `most`) longer than `most` bytes."""
        try:
            fd = os.open(self._path(key), _OPEN_FLAGS)
        except FileNotFoundError:
            with self._idx.lock:
                self._idx.forget(key)
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink or a socket planted under
                return b""  # the key: never followed, reported unusable so it is replaced
            self._warn_once("read", f"read of {key} failed ({exc}); treated as a miss")
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (exact is not None and st.st_size != exact) \
                    or (most is not None and st.st_size > most):
                return b""
            end = st.st_size if length is None else min(st.st_size, start + length)
            parts, pos = [], start
            while pos < end:
                chunk = os.pread(fd, end - pos, pos)
                if not chunk:
                    break
                parts.append(chunk)
                pos += len(chunk)
            return b"".join(parts)
        except OSError as exc:
            self._warn_once("read", f"read of {key} failed ({exc}); treated as a miss")
            return None
        finally:
            os.close(fd)

    def _get(self, key: str) -> Optional[bytes]:
        data = self._read(key, 0, None, None)
        if data:
            self._touch(key, len(data))
        return data

    def _get_sized(self, key: str, size: int) -> Optional[bytes]:
        data = self._read(key, 0, size, size)
        if data:
            self._touch(key, len(data))
        return data

    def _get_bounded(self, key: str, limit: int) -> Optional[bytes]:
        data = self._read(key, 0, limit, None, limit)
        if data:
            self._touch(key, len(data))
        return data

    def _get_range(self, key: str, start: int, length: int) -> Optional[bytes]:
        return self._read(key, start, length, None)

    # ---- writes -----------------------------------------------------------------------------
    def _make_room(self, key: str, size: int) -> None:
        """Evict (or refuse) so that `size` more bytes fit; called with the index lock held."""
        if self.limit_bytes is None:
            return
        if size > self.limit_bytes:
            raise TierWriteError.no_room(
                f"{self.name}: a value of {size} bytes is larger than the whole tier "
                f"(limit_bytes={self.limit_bytes})"
            )
        self._ensure_scanned()
        idx = self._idx
        need = idx.used - idx.sizes.get(key, 0) + size - self.limit_bytes
        if need <= 0:
            return
        if not self.evict:
            raise TierWriteError.no_room(
                f"{self.name} is full: {size} more bytes exceed limit_bytes={self.limit_bytes} "
                f"({idx.used} used; this tier never evicts)"
            )
        for victim in list(idx.sizes):
            if need <= 0:
                break
            if victim == key:
                continue
            vsize = idx.sizes[victim]
            try:
                self._path(victim).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            idx.forget(victim)
            self.stats.evictions += 1
            need -= vsize

    def _put(self, key: str, value: bytes, if_absent: bool) -> bool:
        if self.read_only:
            raise TierWriteError(f"{self.name} is read-only ({self._why_read_only}); "
                                 f"{key} was not stored")
        path = self._path(key)
        if if_absent and _same_size_file(path, len(value)):  # anything else there is replaced
            self._touch(key, len(value))
            return True
        with self._idx.lock:
            self._make_room(key, len(value))
        tmp = fan = None
        try:
            fan = self._fan_dir(path.parent)
            fd, tmp = tempfile.mkstemp(prefix=key[:16] + ".", dir=self.root / _TMP)
            with os.fdopen(fd, "wb") as f:
                f.write(value)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, key, dst_dir_fd=fan)  # into the directory checked, whatever is renamed
            tmp = None
        except OSError as exc:
            room = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            why = "no space left on the device (or over the disk quota)" if room else \
                exc.strerror or str(exc)
            msg = f"{self.name}: writing {key} ({len(value)} bytes) failed: {why}; nothing was stored"
            raise (TierWriteError.no_room(msg) if room else TierWriteError(msg)) from exc
        finally:
            if tmp is not None:
                _unlink_quietly(tmp)
            if fan is not None:
                os.close(fan)
        with self._idx.lock:
            self._idx.add(key, len(value))
        return True

    @staticmethod
    def _fan_dir(path: Path) -> int:
        """An open descriptor of fan-out directory `path`, created 0700 if missing; something
        planted in its place (a symbolic link that would send writes outside the store, a file)
        is removed first."""
        for _ in range(2):
            try:
                path.mkdir(mode=0o700, exist_ok=True)
            except FileExistsError:  # a dangling symbolic link
                pass
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                os.unlink(path)
        raise OSError(errno.ELOOP, "the fan-out directory keeps being replaced", str(path))

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except IsADirectoryError:  # planted under the key: remove it (links inside not followed)
            shutil.rmtree(self._path(key), ignore_errors=True)
            if os.path.lexists(self._path(key)):
                return
        except OSError:
            return
        with self._idx.lock:
            self._idx.forget(key)

    def clear(self) -> None:
        """Delete every value this tier knows of."""
        with self._idx.lock:
            self._ensure_scanned()
            keys = list(self._idx.sizes)
        for key in keys:
            self._delete(key)


def _same_size_file(path: Path, size: int) -> bool:
    """A regular file of `size` bytes is at `path` (a publish that skips existing values then
    still replaces an empty, truncated or planted one it never read)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == size


def _unlink_quietly(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
