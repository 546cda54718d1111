"""The disk tier: atomic writes, size limit with LRU eviction, disk full, reopening."""

from __future__ import annotations

import errno
import os

import pytest

from pagedkv.errors import ConfigError
from pagedkv.offload import DiskTier, MemoryTier, TierWriteError
from pagedkv.offload.config import OffloadConfig, default_cache_dir


def _files(root):
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_put_get_range_delete(tmp_path):
    t = DiskTier(tmp_path / "d")
    assert t.get("abc") is None
    t.put("abc", b"0123456789")
    assert t.get("abc") == b"0123456789"
    assert t.get_range("abc", 2, 3) == b"234"
    assert t.get_range("abc", 8, 5) is None  # short read: truncated value, a miss
    t.delete("abc")
    assert t.get("abc") is None
    assert t.stats.hits == 2 and t.stats.misses == 3
    assert _files(tmp_path / "d" / ".tmp") == []


def test_bad_keys_are_config_errors(tmp_path):
    t = DiskTier(tmp_path)
    for key in ("", "../x", "a/b", "x" * 201, 5):
        with pytest.raises(ConfigError):
            t.get(key)


def test_lru_eviction_keeps_within_limit(tmp_path):
    t = DiskTier(tmp_path, limit_bytes=300)
    for k in ("aa1", "bb2", "cc3"):
        t.put(k, b"x" * 100)
    t.get("aa1")  # now most recent: bb2 is the least recently used
    t.put("dd4", b"y" * 100)
    assert t.get("bb2") is None
    assert {k for k in ("aa1", "cc3", "dd4") if t.get(k) is not None} == {"aa1", "cc3", "dd4"}
    assert t.used_bytes == 300 and t.stats.evictions == 1
    with pytest.raises(TierWriteError, match="larger than the whole tier"):
        t.put("ee5", b"z" * 301)
    assert t.used_bytes == 300


def test_no_evict_tier_refuses_and_writes_nothing(tmp_path):
    t = DiskTier(tmp_path, limit_bytes=250, evict=False)
    t.put("a01", b"x" * 100)
    t.put("a02", b"x" * 100)
    with pytest.raises(TierWriteError, match="full"):
        t.put("a03", b"x" * 100)
    assert t.get("a03") is None and t.get("a01") is not None and t.used_bytes == 200


def test_disk_full_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    t = DiskTier(tmp_path)
    t.put("keep", b"old value")
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            self.f.write(data[: len(data) // 2])  # half written, then the disk fills up
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.raises(TierWriteError, match="no space left"):
        t.put("keep", b"new value that does not fit")
    with pytest.raises(TierWriteError):
        t.put("other", b"abc")
    monkeypatch.undo()
    assert t.get("keep") == b"old value"  # the old value is intact, never half replaced
    assert t.get("other") is None
    assert _files(tmp_path / ".tmp") == []
    assert t.stats.put_failures == 2


def test_reopen_restores_index_and_lru_order(tmp_path):
    t = DiskTier(tmp_path, limit_bytes=1000)
    for i, k in enumerate(("k01", "k02", "k03")):
        t.put(k, bytes([i]) * 100)
        os.utime(t._path(k), (1000 + i, 1000 + i))
    t2 = DiskTier(tmp_path, limit_bytes=250)
    assert len(t2) == 3 and t2.used_bytes == 300
    t2.put("k04", b"n" * 100)  # evicts the two oldest by mtime
    assert t2.get("k01") is None and t2.get("k02") is None and t2.get("k03") is not None


def test_memory_tier_limit():
    t = MemoryTier(limit_bytes=10)
    t.put("a", b"12345")
    with pytest.raises(TierWriteError):
        t.put("b", b"123456")
    assert t.get("b") is None and t.used_bytes == 5


def test_default_dirs_follow_xdg_only_when_given(tmp_path):
    assert default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "pagedkv"
    assert default_cache_dir({"XDG_CACHE_HOME": "relative"}).name == "pagedkv"
    assert default_cache_dir().parent.name == ".cache"
    cfg = OffloadConfig(cache_dir=str(tmp_path))
    assert cfg.swap_path() == tmp_path / "swap" and cfg.prefix_path() == tmp_path / "prefix"
    with pytest.raises(ConfigError, match="prefix_store"):
        OffloadConfig(prefix_store="s3")
    with pytest.raises(ConfigError, match="resident_blocks_per_seq"):
        OffloadConfig(resident_blocks_per_seq=0)


def test_swap_file_slots(tmp_path, monkeypatch):
    from pagedkv.offload import SwapFileTier

    t = SwapFileTier(tmp_path / "sw", limit_bytes=300)
    t.put("a", b"A" * 100)
    t.put("b", b"B" * 90)  # shorter values fit a slot
    assert t.get("a") == b"A" * 100 and t.get_range("b", 10, 5) == b"BBBBB"
    assert t.get_range("b", 85, 10) is None  # past the value: a miss
    with pytest.raises(TierWriteError, match="does not fit"):
        t.put("big", b"x" * 101)
    t.put("c", b"C" * 100)
    with pytest.raises(TierWriteError, match="full"):
        t.put("d", b"D" * 100)  # 3 slots of 100 bytes already
    t.delete("b")
    t.put("d", b"D" * 100)  # reuses b's slot
    assert t.path.stat().st_size == 300 and t.get("d") == b"D" * 100

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    t.delete("c")
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(TierWriteError, match="no space left"):
        t.put("a", b"Z" * 100)
    monkeypatch.undo()
    assert t.get("a") == b"A" * 100  # the old value is intact and still mapped
    t.put("e", b"E" * 100)  # the failed write's slot was returned
    t.close()
    assert not t.path.exists() and t.get("a") is None
