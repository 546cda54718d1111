"""The Redis tier against a real redis-server on loopback: two processes share a prefix; a server
that dies, hangs or runs out of memory costs hits (one warning), never data or the run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.offload import OffloadConfig, TierWarning
from pagedkv.bench.toy import ToyLM
from helpers.redis_server import RedisServer

redis = pytest.importorskip("redis", reason="the redis client package is not installed")

PROMPT = [(11 * i + 2) % 97 for i in range(45)]
CFG = dict(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
           num_blocks=32, high_precision_layers=0, model_id="toy-redis")
SECRET = "test-secret-0123456789"


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path)
    if s.exe is None:
        pytest.skip("redis-server binary not found (Debian: apt-get install redis-server; "
                    "`make test` installs it)")
    yield s.start()
    s.kill()



def _cache(url, **kw):
    return PagedCache(CacheConfig(**CFG), OffloadConfig(prefix_store="redis", redis_url=url,
                                                         redis_timeout_s=0.5, store_secret=SECRET,
                                                         **kw))


@pytest.fixture(scope="module")
def baseline():
    return ToyLM(PagedCache(CacheConfig(**CFG))).generate(PROMPT, 8)


_CHILD = textwrap.dedent("""
    import json, sys, torch
    torch.set_num_threads(1)
    from pagedkv.cache import CacheConfig, PagedCache
    from pagedkv.offload import OffloadConfig
    from pagedkv.bench.toy import ToyLM
    cfg, url, prompt, secret = json.loads(sys.argv[1])
    cache = PagedCache(CacheConfig(**cfg), OffloadConfig(prefix_store="redis", redis_url=url,
                                                          store_secret=secret))
    run = ToyLM(cache).generate(prompt, 8)
    print(json.dumps({"hit_tokens": run.hit_tokens, "prefilled": run.prefilled,
                      "tokens": run.tokens, "stats": cache.offload_stats()["prefix"]}))
""")


def _child(url):
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([CFG, url, PROMPT, SECRET])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_processes_share_a_prefix(server, baseline):
    first = _child(server.url)
    assert first["hit_tokens"] == 0 and first["prefilled"] == 45
    assert first["stats"]["blocks_published"] == 6
    assert len(server.client.keys("pagedkv:pkv2.*")) == 6
    second = _child(server.url)
    assert second["hit_tokens"] == 40 and second["prefilled"] == 5  # loaded, not recomputed
    assert second["stats"]["blocks_loaded"] == 5
    assert first["tokens"] == second["tokens"] == baseline.tokens


def _tier_warnings(caught):
    return [w for w in caught if issubclass(w.category, TierWarning)]


def test_server_killed_mid_run(server, baseline):
    cache = _cache(server.url, redis_retry_after_s=0.2)
    m = ToyLM(cache)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        new = cache.add_sequence(PROMPT)
        logits, o = m.forward(PROMPT, [new.seq_id], new.slot_mapping,
                              torch.tensor([0, len(PROMPT)], dtype=torch.int32))
        cache.commit(new.seq_id)  # 5 blocks published
        server.kill()
        toks, outs = [int(logits[-1].argmax())], [o[-1].clone()]
        for i in range(7):  # decode goes on; the 6th block's publish fails quietly
            time.sleep(0.05)
            batch = cache.step([new.seq_id], [[toks[-1]]])
            logits, o = m.forward([toks[-1]], [new.seq_id], batch.slot_mapping, None)
            cache.commit(new.seq_id)
            toks.append(int(logits[-1].argmax()))
            outs.append(o[-1].clone())
        cache.free(new.seq_id)
        cache.reset_prefix_cache()  # force the next sequence to ask the (dead) server
        again = ToyLM(cache).generate(PROMPT, 8)
    assert toks == baseline.tokens and all(torch.equal(a, b) for a, b in zip(outs, baseline.outputs))
    assert again.hit_tokens == 0 and again.tokens == baseline.tokens  # recomputed
    w = _tier_warnings(caught)
    assert len(w) == 1 and "unreachable" in str(w[0].message)
    st = cache.offload_stats()
    assert st["prefix"]["blocks_published"] == 5 and st["prefix"]["publish_failures"] >= 1
    cache.seqs.check_invariants()


def test_server_out_of_memory(server, baseline):
    server.client.config_set("maxmemory", "1")  # every write is refused (noeviction)
    cache = _cache(server.url)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = ToyLM(cache).generate(PROMPT, 8)
    assert run.tokens == baseline.tokens
    w = _tier_warnings(caught)
    assert len(w) == 1 and "out of memory" in str(w[0].message)
    assert cache.offload_stats()["prefix"]["publish_failures"] == 6
    server.client.config_set("maxmemory", "0")
    cache.free(run.seq_id)
    cache.reset_prefix_cache()
    run2 = ToyLM(cache).generate(PROMPT, 8)  # reads still work; now writes do too
    assert run2.tokens == baseline.tokens
    assert cache.offload_stats()["prefix"]["blocks_published"] == 6


def test_hung_server_times_out_once_then_misses_fast(baseline):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    stop = threading.Event()

    def accept():  # accept connections and never answer
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
        cache = PagedCache(CacheConfig(**CFG), OffloadConfig(
            prefix_store="redis", redis_url=url, redis_timeout_s=0.3, redis_retry_after_s=60,
            store_secret=SECRET))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            run = ToyLM(cache).generate(PROMPT, 8)
            elapsed = time.perf_counter() - t0
        assert run.tokens == baseline.tokens and run.hit_tokens == 0
        w = _tier_warnings(caught)
        assert len(w) == 1 and "slow" in str(w[0].message)
        # one timeout, then every lookup / publish is an instant miss during the quiet period
        st = cache.prefix.tier.stats
        assert st.misses == 5 and st.put_failures == 6 and st.faults >= 2
        assert elapsed < 0.3 * 3 + 5
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        listener.close()


def test_range_reads_and_key_prefix(server):
    from pagedkv.offload import RedisTier

    t = RedisTier(server.url, prefix="x:")
    assert t.put("k1", b"0123456789")
    assert t.get_range("k1", 3, 4) == b"3456"
    assert t.get_range("k1", 8, 4) is None
    assert t.get("nope") is None
    assert server.client.get("x:k1") == b"0123456789"
    assert t.put("k1", b"other", if_absent=True) and t.get("k1") == b"0123456789"
    t.delete("k1")
    assert t.get("k1") is None


def test_prefix_lookup_batches_round_trips(server, baseline):
    ToyLM(_cache(server.url)).generate(PROMPT, 8)
    b = _cache(server.url)
    calls = {"pipeline": 0, "mget": 0, "get": 0}
    client = b.prefix.tier.client
    for name in calls:
        real = getattr(client, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        setattr(client, name, counted)
    new = b.add_sequence(PROMPT)
    assert new.hit_tokens == 40
    assert calls == {"pipeline": 1, "mget": 0, "get": 0}  # 5 blocks in one round trip
    b.free(new.seq_id)
    run = ToyLM(b).generate(PROMPT, 8)
    assert run.hit_tokens == 40 and run.tokens == baseline.tokens
