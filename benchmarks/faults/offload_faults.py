"""Fault suite of the storage tiers: kill, slow, fill and corrupt the Redis and disk prefix stores,
fill the swap file, and race two processes on one store; every run must stay bit-identical.

    .venv/bin/python benchmarks/faults/offload_faults.py [--rounds 3] [--json]

Each run generates a prompt with the toy model (`pagedkv.bench.toy`) on a fresh `PagedCache`
while one fault is injected, and compares the generated tokens and every step's attention output
(`torch.equal`) with a plain `PagedCache` run of the same prompt. Printed counts:
faults injected, runs, runs bit-identical, warnings (TierWarning + the prefix store's logged
"failed its checks" warnings), errors (an exception escaping a run), data lost (a run that
returned different tokens or outputs: wrong K/V used, or planted statistics that were used;
must be 0), planted refused (another user's plants: a disk store directory with a secret the
planter knows and K/V sealed with it, vLLM statistics in a directory others can write or with
non-finite values; each must be a ConfigError), repairs missed (after an empty value, on disk and
on Redis, every prompt must hit all its blocks again; must be 0), and prefix tokens loaded from
the stores (the faults cost hits, not correctness). Redis scenarios need `redis-server` on PATH
(skipped otherwise, and said so). `tests/test_offload_faults.py` runs one round in `make test`.
Each round also runs the vLLM KV connector's cases (`connector_faults.py`: pages handed from
one instance to another through the disk and Redis stores under the same faults; a run is
bit-identical when every page loaded equals the publisher's).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedkv.bench.toy import ToyLM
from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.errors import ConfigError
from pagedkv.offload import OffloadConfig, TierWarning, TierWriteError
from pagedkv.offload.record import RecordError, encode_record, parse_header

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.redis_server import RedisServer  # noqa: E402  (one copy, shared with the tests)
import connector_faults  # noqa: E402  (the vLLM connector's cases)

CFG = dict(num_layers=2, num_kv_heads=2, head_dim=32, kv_format="q8_0", block_size=8,
           num_blocks=48, high_precision_layers=0, model_id="fault-suite")
SECRET = "fault-suite-secret-0123456789"
PROMPTS = [[(a * i + b) % 97 for i in range(45)] for a, b in ((7, 3), (5, 1), (11, 2))]
PROMPTS.append(PROMPTS[0][:24] + PROMPTS[1][24:])  # shares 3 blocks with the first
STEPS = 6
DAMAGE = ("flip", "truncate", "append", "empty", "forge", "copy", "oversize", "fifo", "symlink",
          "directory")
REDIS_DAMAGE = ("flip", "truncate", "append", "empty", "forge", "copy", "oversize", "wrongtype")


@dataclass
class Counts:
    faults_injected: int = 0
    runs: int = 0
    bit_identical: int = 0
    warnings: int = 0
    errors: int = 0
    data_lost: int = 0
    prefix_tokens_loaded: int = 0
    refused: int = 0  # planted secrets / statistics refused with a ConfigError (as they must be)
    repairs_missed: int = 0  # prompts that still missed a block after a damaged entry was seen
    by_fault: dict = field(default_factory=dict)

    def add(self, other: "Counts") -> None:
        """Add another process's counts (its runs; its faults are counted by the caller)."""
        for name in ("runs", "bit_identical", "warnings", "errors", "data_lost",
                     "prefix_tokens_loaded", "refused", "repairs_missed"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class _LogCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record) -> None:
        self.n += 1


_BASELINES: dict = {}


def baseline(prompt):
    key = tuple(prompt)
    if key not in _BASELINES:
        _BASELINES[key] = ToyLM(PagedCache(CacheConfig(**CFG))).generate(prompt, STEPS)
    return _BASELINES[key]


def generate(cache, prompt):
    """ToyLM.generate that survives a swap write failure (commit took effect; retried next)."""
    m = ToyLM(cache)
    commit = cache.commit

    def tolerant(ids):
        try:
            commit(ids)
        except TierWriteError:
            pass

    cache.commit = tolerant
    return m.generate(prompt, STEPS)


def run_one(counts: Counts, make_cache, prompt, fault: str, during=None) -> None:
    """One generation on a fresh cache, `during(cache)` called after its prefill commit."""
    counts.runs += 1
    counts.faults_injected += 1
    counts.by_fault[fault] = counts.by_fault.get(fault, 0) + 1
    log = _LogCount()
    logging.getLogger("pagedkv.offload").addHandler(log)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = make_cache()
            if during is not None:
                real = cache.commit
                state = {"done": False}

                def commit(ids):
                    real(ids)
                    if not state["done"]:
                        state["done"] = True
                        during(cache)

                cache.commit = commit
            run = generate(cache, prompt)
            cache.close()
        counts.warnings += sum(issubclass(w.category, TierWarning) for w in caught) + log.n
    except Exception as exc:  # an escaping exception is an error of the run
        counts.errors += 1
        print(f"  error in {fault}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return
    finally:
        logging.getLogger("pagedkv.offload").removeHandler(log)
    ref = baseline(prompt)
    same = run.tokens == ref.tokens and all(torch.equal(a, b) for a, b in zip(run.outputs, ref.outputs))
    counts.bit_identical += same
    counts.data_lost += not same
    counts.prefix_tokens_loaded += cache.tier_hit_tokens


def _count_fault(counts: Counts, fault: str) -> None:
    counts.faults_injected += 1
    counts.by_fault[fault] = counts.by_fault.get(fault, 0) + 1


def refused_or_identical(counts: Counts, make_cache, prompt, fault: str) -> None:
    """A planted store must be refused (ConfigError naming store_secret); if a cache opens on it
    anyway, its run is counted like any other (wrong K/V is data lost)."""
    try:
        make_cache().close()
    except ConfigError:
        _count_fault(counts, fault)
        counts.refused += 1
        return
    run_one(counts, make_cache, prompt, fault)


def repaired(counts: Counts, make_cache, damage, fault: str) -> None:
    """`damage()` one entry (an empty value), run every prompt twice (a damaged entry is
    replaced when a lookup reads it; one behind an earlier miss is read on the second pass),
    then every prompt must hit all its full blocks again."""
    damage()
    for p in PROMPTS + PROMPTS:
        run_one(counts, make_cache, p, fault)
    counts.faults_injected -= 2 * len(PROMPTS) - 1
    counts.by_fault[fault] -= 2 * len(PROMPTS) - 1
    for i, p in enumerate(PROMPTS):
        cache = make_cache()
        hit = cache.add_sequence(p).hit_tokens
        cache.close()
        if hit != len(p) // 8 * 8:
            counts.repairs_missed += 1
            print(f"  {fault}: prompt {i} hits {hit} tokens after the repair", file=sys.stderr)


# ---- another local user's plants ---------------------------------------------------------------
def planted_scenarios(counts: Counts, tmp: Path, rng: random.Random) -> None:
    """What another local user leaves where this process looks for its own state: a disk store
    directory with a secret the planter knows and K/V of another model sealed with it (the
    directory writable by others; as root also owned by another uid), and vLLM statistics in a
    cache directory others can write (hostile finite centres) or in a private one (non-finite).
    Each must be refused; statistics that were used anyway count as data lost."""
    planted = tmp / "planted"
    secret = os.urandom(32)
    for p in PROMPTS:
        ToyLM(PagedCache(CacheConfig(**CFG), OffloadConfig(
            prefix_store="disk", prefix_dir=str(planted), store_secret=secret)), seed=7).generate(p, STEPS)
    (planted / ".secret").write_bytes(secret)

    def make():
        return PagedCache(CacheConfig(**CFG), OffloadConfig(prefix_store="disk", prefix_dir=str(planted)))

    os.chmod(planted, 0o777)
    refused_or_identical(counts, make, rng.choice(PROMPTS), "planted-secret-writable-dir")
    os.chmod(planted, 0o755)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # the planter's own files
        for path in [planted, *planted.rglob("*")]:
            os.lchown(path, 65534, 65534)
        refused_or_identical(counts, make, rng.choice(PROMPTS), "planted-secret-other-owner")
    planted_statistics(counts, tmp)


def planted_statistics(counts: Counts, tmp: Path) -> None:
    from pagedkv.formats import parse_format
    from pagedkv.integrations.vllm.fit import FIT_VERSION, FitPlan, fit, model_identity

    model = tmp / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    plan = FitPlan.build([parse_format("turbo3")], None, None, False)
    name = plan.key(model_identity(str(model)), 512) + ".pt"
    for fault, mode, value in (("planted-statistics-writable-dir", 0o777, 3.0),
                               ("planted-statistics-non-finite", 0o700, float("nan"))):
        cache = tmp / fault
        cache.mkdir()
        torch.save({"version": FIT_VERSION, "layers": [{"k_centre": torch.full((2, 64), value)}]},
                   cache / name)
        os.chmod(cache, mode)
        _count_fault(counts, fault)
        try:
            fit(str(model), plan, 512, str(cache), [(2, 64)])
        except ConfigError:
            counts.refused += 1
        else:  # the engine would have served every request with the planted statistics
            counts.data_lost += 1


# ---- damage to stored entries ------------------------------------------------------------------
def _forged(value: bytes) -> bytes:
    """A well-formed record (valid checksums) with zeroed K/V, as a writer without the secret
    can make it: same length, the tag left as it was (an entry damaged earlier: left as is)."""
    try:
        head = parse_header(value)
    except RecordError:
        return value
    zeros = [(bytes(lay.k_bytes), bytes(lay.v_bytes)) for lay in head.layout.layers]
    rec = encode_record(head.layout, head.key, zeros)
    return rec + value[len(rec):]


def damage_value(kind: str, value: bytes, other: bytes, rng: random.Random) -> bytes:
    if kind == "flip":
        b = bytearray(value)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == "truncate":
        return value[:rng.randrange(1, len(value))]
    if kind == "append":
        return value + b"\0" * rng.randrange(1, 64)
    if kind == "empty":
        return b""
    if kind == "forge":
        return _forged(value)
    if kind == "copy":
        return other
    raise ValueError(kind)


def damage_disk(root: Path, kind: str, rng: random.Random) -> None:
    files = sorted(p for p in root.rglob("pkv*") if p.parent.name != ".tmp" and p.is_file())
    if len(files) < 2:
        return
    victim, other = rng.sample(files, 2)
    if kind in ("flip", "truncate", "append", "empty", "forge", "copy"):
        victim.write_bytes(damage_value(kind, victim.read_bytes(), other.read_bytes(), rng))
        return
    victim.unlink()
    if kind == "oversize":
        with open(victim, "wb") as f:
            f.truncate(256 << 20)  # sparse
    elif kind == "fifo":
        os.mkfifo(victim)
    elif kind == "symlink":
        victim.symlink_to(other)
    elif kind == "directory":
        victim.mkdir()


def damage_redis(client, kind: str, rng: random.Random, pattern: str = "faults:pkv*") -> None:
    keys = sorted(client.keys(pattern))
    if len(keys) < 2:
        return
    victim, other = rng.sample(keys, 2)
    if kind == "wrongtype":
        client.delete(victim)
        client.rpush(victim, b"x")
    elif kind == "oversize":
        client.setrange(victim, (64 << 20) - 1, b"\0")
    else:
        client.set(victim, damage_value(kind, client.get(victim), client.get(other), rng))


@contextlib.contextmanager
def redis_full(client):
    """The server at its maxmemory (noeviction) while inside: writes fail with OOM."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used + 4096))
    try:
        yield
    finally:
        client.config_set("maxmemory", "0")


# ---- scenarios ---------------------------------------------------------------------------------
def disk_scenarios(counts: Counts, root: Path, rng: random.Random) -> None:
    def make(**kw):
        return lambda: PagedCache(CacheConfig(**CFG), OffloadConfig(
            prefix_store="disk", prefix_dir=str(root), store_secret=SECRET, **kw))

    for p in PROMPTS:  # warm the store: later runs hit
        run_one(counts, make(), p, "disk-warm")
    counts.faults_injected -= len(PROMPTS)
    counts.by_fault.pop("disk-warm")
    for kind in DAMAGE:
        damage_disk(root, kind, rng)
        run_one(counts, make(), rng.choice(PROMPTS), f"disk-{kind}")

    def no_space(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    shutil.rmtree(root, ignore_errors=True)  # so that the run has blocks to publish
    real_replace, os.replace = os.replace, no_space
    try:
        run_one(counts, make(), rng.choice(PROMPTS), "disk-full")
    finally:
        os.replace = real_replace
    run_one(counts, make(), rng.choice(PROMPTS), "disk-removed",
            during=lambda cache: shutil.rmtree(root, ignore_errors=True))
    run_one(counts, make(prefix_limit_bytes=3000), rng.choice(PROMPTS), "disk-tiny-limit")

    def empty_file():
        files = [p for p in root.rglob("pkv*") if p.parent.name != ".tmp" and p.is_file()]
        rng.choice(files).write_bytes(b"")

    repaired(counts, make(), empty_file, "disk-empty-repaired")
    run_one(counts, lambda: PagedCache(CacheConfig(**CFG), OffloadConfig(
        resident_blocks_per_seq=1, swap_limit_bytes=6000, cache_dir=str(root.parent / "c"))),
        rng.choice(PROMPTS), "swap-full")


def redis_scenarios(counts: Counts, server: RedisServer, rng: random.Random) -> None:
    def make(**kw):
        kw.setdefault("redis_timeout_s", 0.3)
        kw.setdefault("redis_retry_after_s", 0.2)
        return lambda: PagedCache(CacheConfig(**CFG), OffloadConfig(
            prefix_store="redis", redis_url=server.url, redis_prefix="faults:",
            store_secret=SECRET, **kw))

    for p in PROMPTS:
        run_one(counts, make(), p, "redis-warm")
    counts.faults_injected -= len(PROMPTS)
    counts.by_fault.pop("redis-warm")
    for kind in REDIS_DAMAGE:
        damage_redis(server.client, kind, rng)
        run_one(counts, make(), rng.choice(PROMPTS), f"redis-{kind}")
    repaired(counts, make(redis_timeout_s=5), lambda: server.client.set(
        rng.choice(sorted(server.client.keys("faults:pkv*"))), b""), "redis-empty-repaired")
    run_one(counts, make(), rng.choice(PROMPTS), "redis-flushed",
            during=lambda cache: server.client.flushall())

    def hang(cache):
        server.proc.send_signal(signal.SIGSTOP)

    run_one(counts, make(), rng.choice(PROMPTS), "redis-hung", during=hang)
    server.proc.send_signal(signal.SIGCONT)
    server.client.flushall()
    with redis_full(server.client):
        run_one(counts, make(), rng.choice(PROMPTS), "redis-full")
    run_one(counts, make(), rng.choice(PROMPTS), "redis-killed", during=lambda cache: server.kill())
    run_one(counts, make(), rng.choice(PROMPTS), "redis-down")
    server.start()


_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import offload_faults as F
F.torch.set_num_threads(1)
counts = F.Counts()
F.race_child(counts, *json.loads(sys.argv[2]))
print(json.dumps(F.asdict(counts)))
"""


def race_child(counts: Counts, disk_root: str, redis_url, rounds: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(rounds):
        for p in rng.sample(PROMPTS, len(PROMPTS)):
            run_one(counts, lambda: PagedCache(CacheConfig(**CFG), OffloadConfig(
                prefix_store="disk", prefix_dir=disk_root, store_secret=SECRET)), p, "race-disk")
            if redis_url:
                run_one(counts, lambda: PagedCache(CacheConfig(**CFG), OffloadConfig(
                    prefix_store="redis", redis_url=redis_url, redis_prefix="race:",
                    store_secret=SECRET)), p, "race-redis")


def race(counts: Counts, disk_root: Path, redis_url, rounds: int) -> None:
    """Two processes publish and load the same prompts on one disk store and one Redis."""
    here = str(Path(__file__).resolve().parent)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [src] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, here,
                               json.dumps([str(disk_root), redis_url, rounds, seed])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for seed in (1, 2)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        counts.faults_injected += 1
        counts.by_fault["race"] = counts.by_fault.get("race", 0) + 1
        if p.returncode != 0:
            counts.errors += 1
            print(f"  race child failed: {err.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        counts.add(Counts(**json.loads(out.strip().splitlines()[-1])))


def run_suite(rounds: int = 3, seed: int = 0, redis: bool = True) -> dict:
    torch.set_num_threads(1)
    counts = Counts()
    rng = random.Random(seed)
    redis_note = "ran"
    with tempfile.TemporaryDirectory(prefix="pagedkv-faults-") as tmp:
        tmp = Path(tmp)
        server = None
        if redis:
            try:
                import redis as _redis  # noqa: F401
            except ImportError:
                redis_note = "skipped (no redis package)"
            else:
                if shutil.which("redis-server") is None:
                    redis_note = "skipped (no redis-server on PATH)"
                else:
                    server = RedisServer(tmp)
                    server.start()
        else:
            redis_note = "skipped (--no-redis)"
        try:
            for r in range(rounds):
                disk_scenarios(counts, tmp / f"disk{r}" / "prefix", rng)
                planted_scenarios(counts, tmp / f"planted{r}", rng)
                connector_faults.disk_cases(counts, tmp / f"conn{r}" / "store", rng, sys.modules[__name__])
                if server is not None:
                    redis_scenarios(counts, server, rng)
                    connector_faults.redis_cases(counts, server, tmp / "conn-secret", rng,
                                                 sys.modules[__name__])
            race(counts, tmp / "race", server.url if server is not None else None, 1)
        finally:
            if server is not None:
                with contextlib.suppress(Exception):
                    server.kill()
    out = asdict(counts)
    out["redis"] = redis_note
    out["rounds"] = rounds
    return out


def format_counts(c: dict) -> str:
    lines = [f"fault suite: {c['rounds']} round(s), redis {c['redis']}",
             f"  faults injected   {c['faults_injected']}",
             f"  runs              {c['runs']}",
             f"  bit-identical     {c['bit_identical']}",
             f"  warnings          {c['warnings']}",
             f"  errors            {c['errors']}",
             f"  data lost         {c['data_lost']}",
             f"  planted refused   {c['refused']}",
             f"  repairs missed    {c['repairs_missed']}",
             f"  prefix tokens loaded from the stores: {c['prefix_tokens_loaded']}",
             "  faults: " + ", ".join(f"{k} {v}" for k, v in sorted(c["by_fault"].items()))]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    c = run_suite(args.rounds, args.seed, redis=not args.no_redis)
    print(json.dumps(c) if args.json else format_counts(c))
    return 0 if c["data_lost"] == 0 and c["errors"] == 0 and c["repairs_missed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
