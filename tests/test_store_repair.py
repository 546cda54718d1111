"""Damaged entries of a shared prefix store are repaired, not missed forever, and reads stay
bounded (issue 28: N4 the transform side record, N7 an empty Redis value, N10 the smaller
ones)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedkv.bench.toy import ToyLM
from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.cache.transform_record import TRANSFORM_RECORD, SharedTransform
from pagedkv.offload import DiskTier, OffloadConfig
from pagedkv.offload.keys import StoreKeys
from pagedkv.offload.prefix import PrefixStore
from helpers.redis_server import RedisServer

PROMPT = [(5 * i + 1) % 97 for i in range(45)]
SHAPES = [{"k_centre": (2, 64), "k_mult": (2, 64), "v_centre": (2, 64), "k_scale": (1,),
           "v_scale": (1,)}] * 3


def _transforms(seed):
    g = torch.Generator().manual_seed(seed)
    return [{"k_centre": torch.randn(2, 64, generator=g), "k_mult": None,
             "v_centre": torch.randn(2, 64, generator=g), "k_scale": None,
             "v_scale": torch.ones(1)} for _ in SHAPES]


def _shared(tier):
    st = SharedTransform()
    st.store = PrefixStore(tier, StoreKeys(b"k" * 32, b"identity"))
    return st


def _same(a, b):
    return all((x[f] is None and y[f] is None) or torch.equal(x[f], y[f])
               for x, y in zip(a, b) for f in x)


# ---- N4: the transform side record ---------------------------------------------------------------
def test_a_damaged_transform_record_is_deleted_and_republished(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(SharedTransform, "_damage_warned", False, raising=False)
    tier = DiskTier(tmp_path / "store")
    first = _shared(tier)
    first.publish_transform(_transforms(0))
    key = first.store.keys.aux_key(TRANSFORM_RECORD)
    path = tier._path(key)
    raw = bytearray(path.read_bytes())
    raw[40] ^= 1  # one flipped byte
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING)
    damaged = _shared(tier)
    assert damaged.stored_transform(SHAPES) is None
    assert damaged.store.stats.damaged_removed == 1
    path.write_bytes(bytes(raw))  # damaged again (another cache's store): no second warning
    fresh = _shared(tier)
    assert fresh.stored_transform(SHAPES) is None
    assert not path.exists()  # deleted ...
    assert sum("transform record" in r.getMessage() for r in caplog.records) == 1  # warned once
    fresh.publish_transform(_transforms(1))  # ... so the next cache's own is published
    got = _shared(tier).stored_transform(SHAPES)
    assert got is not None and _same(got, _transforms(1))


def test_an_oversized_transform_record_is_not_read_whole(tmp_path):
    tier = DiskTier(tmp_path / "store")
    st = _shared(tier)
    key = st.store.keys.aux_key(TRANSFORM_RECORD)
    tier.put(key, b"x")
    with open(tier._path(key), "r+b") as f:
        f.truncate(256 << 20)  # sparse: 256 MiB to a reader that reads it whole
    assert st.stored_transform(SHAPES) is None
    assert tier.stats.bytes_read < 1 << 20
    assert not tier._path(key).exists()


# ---- N7: an empty Redis value --------------------------------------------------------------------
@pytest.fixture
def server(tmp_path):
    pytest.importorskip("redis", reason="the redis client package is not installed")
    s = RedisServer(tmp_path)
    if s.exe is None:
        pytest.skip("redis-server binary not found (Debian: apt-get install redis-server)")
    yield s.start()
    s.kill()


def test_an_empty_redis_value_is_damage_and_is_repaired(server):
    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
                      num_blocks=32, high_precision_layers=0, model_id="toy-empty")
    base = ToyLM(PagedCache(cfg)).generate(PROMPT, 8)

    def cache():
        return PagedCache(cfg, OffloadConfig(prefix_store="redis", redis_url=server.url,
                                             store_secret="empty-secret-0123456789"))

    ToyLM(cache()).generate(PROMPT, 8)
    keys = sorted(server.client.keys("pagedkv:pkv2.*"))
    assert len(keys) == 6
    victim = cache()
    chains = victim.prefix.keys  # the second block's key, emptied
    from pagedkv.alloc.hashing import chain, root_hash

    hashes = chain(root_hash(victim.seqs.namespace, None), PROMPT, 8)
    k1 = "pagedkv:" + chains.key(victim.layout, hashes[1])
    server.client.set(k1, b"")
    run = ToyLM(victim).generate(PROMPT, 8)
    assert run.hit_tokens == 8 and run.tokens == base.tokens
    assert victim.offload_stats()["prefix"]["damaged_removed"] == 1
    assert server.client.strlen(k1) > 0  # republished
    again = ToyLM(cache()).generate(PROMPT, 8)
    assert again.hit_tokens == 40 and again.tokens == base.tokens
    # the transform record's bounded read sees an empty value as damage too
    st = _shared(victim.prefix.tier)
    key = st.store.keys.aux_key(TRANSFORM_RECORD)
    server.client.set("pagedkv:" + key, b"")
    assert st.stored_transform(SHAPES) is None and not server.client.exists("pagedkv:" + key)


# ---- N10: the smaller ones -----------------------------------------------------------------------
def _toy_cfg():
    return CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
                       num_blocks=32, high_precision_layers=0, model_id="toy-repair")


@pytest.fixture
def short_dir():
    """A short directory path: a unix socket's path must fit in 108 bytes."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="pkv-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_symlinked_fan_out_directory_never_receives_writes(tmp_path):
    from pagedkv.offload.disk import fan_out

    tier = DiskTier(tmp_path / "store")
    tier.put("k1", b"one")
    fan = tmp_path / "store" / fan_out("k2")
    outside = tmp_path / "outside"
    outside.mkdir()
    if fan.exists():
        import shutil

        shutil.rmtree(fan)
    fan.symlink_to(outside)  # planted: writes under it would land outside the store
    tier.put("k2", b"two")
    assert list(outside.iterdir()) == []
    assert fan.is_dir() and not fan.is_symlink() and tier.get("k2") == b"two"


@pytest.mark.parametrize("planted", ["socket", "non-empty directory"])
def test_a_socket_or_a_full_directory_under_a_key_is_replaced(short_dir, planted):
    import socket

    cfg = _toy_cfg()
    base = ToyLM(PagedCache(cfg)).generate(PROMPT, 8)

    def cache():
        return PagedCache(cfg, OffloadConfig(prefix_store="disk", prefix_dir=short_dir))

    ToyLM(cache()).generate(PROMPT, 8)
    from pathlib import Path

    victim = min((p for p in Path(short_dir).rglob("pkv2.*") if p.parent.name != ".tmp"),
                 key=lambda p: p.stat().st_mtime_ns)
    victim.unlink()
    if planted == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(victim))
        sock.close()
    else:
        victim.mkdir()
        (victim / "inner").write_bytes(b"x")
    run = ToyLM(cache()).generate(PROMPT, 8)
    assert run.hit_tokens == 0 and run.tokens == base.tokens
    assert victim.is_file()  # removed and republished: the next cache hits
    assert cache().add_sequence(PROMPT).hit_tokens == 40


def test_a_key_with_a_trailing_newline_is_refused(tmp_path):
    from pagedkv.errors import ConfigError

    tier = DiskTier(tmp_path / "store")
    for bad in ("key\n", "pkv2.ab\n"):
        with pytest.raises(ConfigError, match="tier key"):
            tier.put(bad, b"v")
    assert [p.name for p in (tmp_path / "store").rglob("*") if p.is_file()] == []


def test_a_read_only_store_does_not_promise_room(tmp_path, monkeypatch):
    import errno
    import warnings

    from pagedkv.offload import TierWarning

    tier = DiskTier(tmp_path / "store")
    store = PrefixStore(tier, StoreKeys(b"k" * 32, b"identity"))

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(DiskTier, "_fan_dir", staticmethod(denied))
    cache = PagedCache(_toy_cfg())  # block 0's bytes (zeros) are published as they are
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.publish(cache.layers, cache.layout, 0, b"c" * 32)
    msgs = [str(w.message) for w in caught if issubclass(w.category, TierWarning)]
    assert len(msgs) == 1 and "Permission denied" in msgs[0] and "until it has room" not in msgs[0]
    monkeypatch.undo()
    small = PrefixStore(DiskTier(tmp_path / "small", limit_bytes=10), store.keys)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        small.publish(cache.layers, cache.layout, 0, b"c" * 32)
    assert "until it has room" in str(caught[0].message)  # a full store: it may have room later


def test_a_damaged_swap_record_header_does_not_lose_the_block(tmp_path):
    cfg = CacheConfig(num_layers=3, num_kv_heads=2, head_dim=32, kv_format="turbo3", block_size=8,
                      num_blocks=48, high_precision_layers=0)

    def popped(damage):
        tc = PagedCache(cfg, OffloadConfig(resident_blocks_per_seq=1, cache_dir=str(tmp_path / damage),
                                           prefetch=False))
        run = ToyLM(tc).generate(PROMPT + PROMPT[:9], 1)  # 54 tokens kept: blocks 0..5 swapped
        tier = tc.swap.tier
        keys = sorted(tier._slots, key=lambda k: tier._slots[k][0])
        if damage == "header":
            slot, _ = tier._slots[keys[5]]
            with open(tier.path, "r+b") as f:  # a byte of record 5's header (its codec names)
                f.seek(slot * tier.slot_bytes + 30)
                b = f.read(1)
                f.seek(slot * tier.slot_bytes + 30)
                f.write(bytes([b[0] ^ 0xFF]))
        tc.pop(run.seq_id, 13)  # 41 of 54 tokens: block 5, swapped, is read back whole
        q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
        outs = [tc.decode_attention(i, q, [run.seq_id], ToyLM(tc).params[i]) for i in range(3)]
        tc.close()
        return outs

    for a, b in zip(popped("none"), popped("header")):
        assert torch.equal(a, b)


def test_writes_a_timeout_cut_are_counted_by_what_the_server_stored(server, monkeypatch):
    """A pipeline whose reply is lost (the server paused after storing) was counted as 6 failed
    publishes though the server held them: once the server answers again the tier asks it."""
    import redis as redis_mod

    cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
                      num_blocks=32, high_precision_layers=0, model_id="toy-settle")
    cache = PagedCache(cfg, OffloadConfig(prefix_store="redis", redis_url=server.url,
                                          store_secret="settle-secret-0123456789",
                                          redis_retry_after_s=0))
    real = redis_mod.client.Pipeline.execute
    state = {"cut": 0}

    def cut(self, *a, **kw):
        writes = any(c[0][0] == "SET" for c in self.command_stack)
        out = real(self, *a, **kw)  # the server stored the values ...
        if writes and not state["cut"]:
            state["cut"] = 1
            raise redis_mod.exceptions.TimeoutError("Timeout reading from socket")  # ... no reply
        return out

    monkeypatch.setattr(redis_mod.client.Pipeline, "execute", cut)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ToyLM(cache).generate(PROMPT, 8)  # publishes blocks 0..4 in one pipeline (cut), then 5
        assert state["cut"] == 1
        cache.add_sequence(PROMPT[:20])  # the server answers again
    tier, stats = cache.prefix.tier.stats, cache.offload_stats()["prefix"]
    stored = len(server.client.keys("pagedkv:pkv2.*"))
    assert stored == tier.puts == stats["blocks_published"] == 6
    assert tier.put_failures == stats["publish_failures"] == 0


def test_a_publish_replaces_a_wrong_sized_value_it_never_read(tmp_path):
    """Publishing skips values already stored, but an empty or truncated file under the key (a
    damaged entry behind an earlier miss, which no lookup has read yet) is replaced."""
    tier = DiskTier(tmp_path / "store")
    tier.put("pkv2.k", b"")
    assert tier.put("pkv2.k", b"value", if_absent=True) and tier.get("pkv2.k") == b"value"
    tier.put("pkv2.k", b"val", if_absent=False)
    assert tier.put("pkv2.k", b"value", if_absent=True) and tier.get("pkv2.k") == b"value"
    assert tier.put("pkv2.k", b"other", if_absent=True) and tier.get("pkv2.k") == b"value"
