"""Trust boundaries of the Redis prefix store against a real redis-server (issue 12): a secret is
required, tenants get a key namespace an ACL user can be confined to, reads are bounded (STRLEN /
GETRANGE), and a damaged or foreign-typed entry is replaced instead of blocking its prompt."""

from __future__ import annotations

import pytest

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import ConfigError
from pagedkv.offload import OffloadConfig
from pagedkv.bench.toy import ToyLM
from test_offload_redis import CFG, PROMPT, SECRET, server  # noqa: F401 (fixture)

redis = pytest.importorskip("redis", reason="the redis client package is not installed")


def _cache(url, **kw):
    kw.setdefault("store_secret", SECRET)
    return PagedCache(CacheConfig(**CFG), OffloadConfig(prefix_store="redis", redis_url=url,
                                                         redis_timeout_s=2, **kw))


@pytest.fixture(scope="module")
def baseline():
    return ToyLM(PagedCache(CacheConfig(**CFG))).generate(PROMPT, 8)


def _keys(server, pattern="pagedkv:pkv*"):
    return sorted(server.client.keys(pattern))


def test_a_redis_store_needs_a_secret(server):  # noqa: F811
    with pytest.raises(ConfigError, match=r"store_secret=.*token_hex"):
        PagedCache(CacheConfig(**CFG), OffloadConfig(prefix_store="redis", redis_url=server.url))


def test_a_damaged_entry_is_replaced(server, baseline):  # noqa: F811
    ToyLM(_cache(server.url)).generate(PROMPT, 8)
    # which key holds which block: publish order is block order, one pipeline per commit
    b = _cache(server.url)
    layout = b.layout
    from pagedkv.alloc.hashing import chain, root_hash

    chains = chain(root_hash(b.seqs.namespace, None), PROMPT, 8)
    keys = [b.prefix.keys.key(layout, c) for c in chains]
    server.client.set("pagedkv:" + keys[2], b"garbage")
    rb = ToyLM(b).generate(PROMPT, 8)
    assert rb.hit_tokens == 16 and rb.tokens == baseline.tokens
    assert b.offload_stats()["prefix"]["damaged_removed"] == 1
    rc = ToyLM(_cache(server.url)).generate(PROMPT, 8)  # b's publish replaced it
    assert rc.hit_tokens == 40 and rc.tokens == baseline.tokens
    # another type under a key (WRONGTYPE) is damage too, not a fault of the server
    server.client.delete("pagedkv:" + keys[0])
    server.client.rpush("pagedkv:" + keys[0], b"x")
    d = _cache(server.url)
    assert d.add_sequence(PROMPT).hit_tokens == 0
    assert server.client.type("pagedkv:" + keys[0]) == b"none"  # removed, so it can be replaced
    assert d.prefix.tier.stats.faults == 0


def test_an_oversized_value_is_not_fetched(server, baseline):  # noqa: F811
    ToyLM(_cache(server.url)).generate(PROMPT, 8)
    size = server.client.strlen(_keys(server)[0])
    big = 32 << 20
    for k in _keys(server):
        server.client.setrange(k, big - 1, b"\0")  # every entry padded to 32 MiB
    b = _cache(server.url)
    assert b.add_sequence(PROMPT).hit_tokens == 0
    assert b.prefix.tier.stats.bytes_read <= 8 * size  # read at most the expected size each


def test_tenant_namespaces_and_acl_users(server, baseline):  # noqa: F811
    c = server.client
    for user, ns in (("alice", "a"), ("bob", "b")):
        c.execute_command("ACL", "SETUSER", user, "on", f">{user}-pw", "resetkeys",
                          f"~pagedkv:{ns}:*", "-@all", "+get", "+set", "+strlen", "+getrange",
                          "+mget", "+del", "+ping", "+client", "+hello")
    port = server.port
    alice = f"redis://alice:alice-pw@127.0.0.1:{port}/0"
    ToyLM(_cache(alice, store_namespace="a")).generate(PROMPT, 8)
    assert len(_keys(server, "pagedkv:a:pkv2.*")) == 6 and _keys(server) == []
    ra = ToyLM(_cache(alice, store_namespace="a")).generate(PROMPT, 8)
    assert ra.hit_tokens == 40 and ra.tokens == baseline.tokens
    # bob's user cannot touch alice's keys: pointing his cache at her namespace is a miss
    bob = f"redis://bob:bob-pw@127.0.0.1:{port}/0"
    with pytest.warns(UserWarning, match="NOPERM|permission"):
        rb = ToyLM(_cache(bob, store_namespace="a", redis_retry_after_s=0)).generate(PROMPT, 8)
    assert rb.hit_tokens == 0 and rb.tokens == baseline.tokens
    with pytest.raises(redis.exceptions.NoPermissionError):
        redis.Redis.from_url(bob).get(_keys(server, "pagedkv:a:pkv2.*")[0])


def test_a_password_in_the_url_is_never_printed_and_noperm_says_so(server, baseline, caplog):  # noqa: F811
    """Issue 28 N3: the URL's password stays out of warnings, log lines, reprs and errors; a user
    the ACL denies gets a warning that says so (not "failed its checks; deleted it")."""
    import logging
    import warnings

    pw = "pw-Zq81-carol"
    server.client.execute_command("ACL", "SETUSER", "carol", "on", f">{pw}", "resetkeys",
                                  "~other:*", "-@all", "+get", "+set", "+strlen", "+getrange",
                                  "+mget", "+del", "+ping", "+client", "+hello")
    url = f"redis://carol:{pw}@127.0.0.1:{server.port}/0"
    cfg = OffloadConfig(prefix_store="redis", redis_url=url, store_secret=SECRET)
    assert pw not in repr(cfg) and "carol:***@127.0.0.1" in repr(cfg)
    with pytest.raises(ConfigError) as err:
        PagedCache(CacheConfig(**CFG), OffloadConfig(prefix_store="redis", redis_url=url))
    assert pw not in str(err.value)
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = _cache(url, redis_retry_after_s=0)
        run = ToyLM(cache).generate(PROMPT, 8)
        server.kill()  # and a dead server's warning
        ToyLM(_cache(url, redis_retry_after_s=0)).generate(PROMPT, 8)
    assert run.tokens == baseline.tokens and run.hit_tokens == 0
    texts = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert texts and all(pw not in t for t in texts), texts
    assert any("ACL denies" in t and "NOPERM" in t for t in texts), texts
    assert any("unreachable" in t for t in texts), texts
    assert not any("failed its checks" in t for t in texts), texts
    assert cache.offload_stats()["prefix"]["damaged_removed"] == 0
    assert pw not in cache.prefix.tier.name
