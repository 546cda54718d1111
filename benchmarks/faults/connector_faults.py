"""The vLLM connector's cases of the fault suite (`offload_faults.py` runs them each round).

The connector (`pagedkv.integrations.vllm.connector`) moves pages through `fleet.RankPages`: an
instance publishes a prompt's blocks, another looks them up (the scheduler's `probe`) and loads
them into its own blocks (the worker's `load`); blocks it does not load are recomputed by vLLM.
Each run here is one such hand-over between two instances' pages (3 layers of turbo3 and q8_0,
random bytes standing in for a model's K/V, fitted statistics), with one fault injected: entries
damaged before the look-up (every kind the disk and Redis scenarios use), an entry damaged or the
store removed, flushed, hung or killed between the look-up and the load, the disk or Redis full
while publishing. A run is bit-identical when every page it loaded equals the publisher's and it
loaded no more than the look-up found (vLLM recomputes the rest); a loaded page that differs is
data lost. The end-to-end tokens under these faults are tests_vllm/test_fleet.py's.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import warnings
from pathlib import Path

import torch

from pagedkv.cache.calibration import Calibration
from pagedkv.formats import parse_format
from pagedkv.integrations.vllm.fleet import ConnectorSettings, RankPages, open_store, probe, rank_identity
from pagedkv.integrations.vllm.layout import content_bytes, paged_layer
from pagedkv.offload import TierWarning

FORMATS, HEADS, DIM, BLOCK, POOL = ("turbo3", "q8_0", "turbo3"), 2, 64, 16, 8
CHAINS = [bytes([7, i]) * 8 for i in range(6)]
IDENTITY = rank_identity("fault-suite-connector", "torch.float32", BLOCK, 0, 1)


def pages(seed: int) -> list:
    """One instance's pages: the same format and statistics, its own random bytes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, name in enumerate(FORMATS):
        f = parse_format(name)
        kv = torch.randint(0, 256, (POOL, HEADS, BLOCK, content_bytes(f, DIM)), dtype=torch.uint8, generator=g)
        centre = torch.linspace(-1, 1, HEADS * DIM).reshape(HEADS, DIM) * (i + 1)
        out.append(paged_layer(kv, f, HEADS, DIM, Calibration(k_centre=centre)))
    return out


def instance(extra: dict, seed: int) -> RankPages:
    return RankPages(pages(seed), open_store(ConnectorSettings.parse(extra), IDENTITY), IDENTITY)


def handover(suite, counts, extra: dict, fault: str, before=None, between=None, publish=True) -> None:
    """Instance A publishes blocks 0..5; `before()`; B probes, `between()`, loads into its blocks
    7, 6, ..; checks what B loaded against A's pages (see the module docstring)."""
    counts.runs += 1
    counts.faults_injected += 1
    counts.by_fault[fault] = counts.by_fault.get(fault, 0) + 1
    log = suite._LogCount()
    logging.getLogger("pagedkv").addHandler(log)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = instance(extra, seed=1)
            if publish:
                a.publish(list(zip(range(len(CHAINS)), CHAINS)))
            if before is not None:
                before()
            b = instance(extra, seed=2)
            found = probe([(b.store, b.layout)], CHAINS)
            if between is not None:
                between()
            targets = [POOL - 1 - i for i in range(found)]
            loaded = b.load(targets, CHAINS[:found])
        counts.warnings += sum(issubclass(w.category, TierWarning) for w in caught) + log.n
    except Exception as exc:  # an escaping exception would fail the engine's step: an error
        counts.errors += 1
        print(f"  error in {fault}: {type(exc).__name__}: {exc}")
        return
    finally:
        logging.getLogger("pagedkv").removeHandler(log)
    same = loaded <= found and all(
        torch.equal(la.k_pool[src], lb.k_pool[dst]) and torch.equal(la.v_pool[src], lb.v_pool[dst])
        for la, lb in zip(a.layers, b.layers) for src, dst in zip(range(loaded), targets))
    counts.bit_identical += same
    counts.data_lost += not same
    counts.prefix_tokens_loaded += loaded * BLOCK


def disk_cases(counts, root: Path, rng, suite) -> None:
    """The disk store's cases (`suite`: offload_faults, whose damage kinds and helpers they use)."""
    extra = {"path": str(root), "store_secret_file": str(root.parent / "secret")}
    root.parent.mkdir(parents=True, exist_ok=True)
    (root.parent / "secret").write_text("connector-fault-secret-0123456789")
    handover(suite, counts, extra, "connector-disk-warm")
    counts.faults_injected -= 1
    counts.by_fault.pop("connector-disk-warm")
    for kind in suite.DAMAGE:
        handover(suite, counts, extra, f"connector-disk-{kind}",
                 before=lambda k=kind: suite.damage_disk(root, k, rng))
    handover(suite, counts, extra, "connector-disk-damaged-after-lookup",
             between=lambda: suite.damage_disk(root, "flip", rng))
    handover(suite, counts, extra, "connector-disk-removed-after-lookup",
             between=lambda: shutil.rmtree(root, ignore_errors=True))

    def no_space(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    shutil.rmtree(root, ignore_errors=True)
    real, os.replace = os.replace, no_space
    try:
        handover(suite, counts, extra, "connector-disk-full")
    finally:
        os.replace = real


def redis_cases(counts, server, secret_file: Path, rng, suite) -> None:
    """The Redis store's cases (the suite's server, restarted at the end)."""
    extra = {"store": "redis", "redis_url": server.url, "store_secret_file": str(secret_file),
             "namespace": "conn", "redis_timeout_s": 0.3, "redis_retry_after_s": 0.2}
    secret_file.write_text("connector-fault-secret-0123456789")
    client = server.client
    for kind in suite.REDIS_DAMAGE:
        handover(suite, counts, extra, f"connector-redis-{kind}",
                 before=lambda k=kind: suite.damage_redis(client, k, rng, "pagedkv:conn:pkv*"))
    handover(suite, counts, extra, "connector-redis-flushed-after-lookup", between=client.flushall)
    handover(suite, counts, extra, "connector-redis-hung-after-lookup",
             between=lambda: server.proc.send_signal(signal.SIGSTOP))
    server.proc.send_signal(signal.SIGCONT)
    client.flushall()
    with suite.redis_full(client):
        handover(suite, counts, extra, "connector-redis-full")
    handover(suite, counts, extra, "connector-redis-killed-after-lookup", between=server.kill)
    handover(suite, counts, extra, "connector-redis-down", publish=False)
    server.start()
