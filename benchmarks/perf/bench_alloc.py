"""Bookkeeping speed of the block pool and the cache (no attention, no model).

Prints medians over repeats:
- pool alloc+free (one block) and sequence append (one token, `BlockManager.step`) ops/sec
  with 100k blocks;
- prefix lookup ops/sec with 100k keyed blocks (index probe alone, and chain hash + probe);
- one decode step for 64 sequences: slot allocation + block-table / slot-mapping / seq-len
  tensors (`PagedCache.step`), target <= 200 us; and the commit that follows it.

Run: .venv/bin/python benchmarks/perf/bench_alloc.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.alloc import BlockPool, chain_hash, root_hash
from pagedkv.alloc.manager import BlockManager, GroupSpec
from pagedkv.cache import CacheConfig, PagedCache

N_BLOCKS = 100_000


def _median_rate(fn, n_ops: int, repeats: int) -> float:
    """Median ops/sec of `fn()` (which performs n_ops operations) over repeats."""
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(n_ops / (time.perf_counter() - t0))
    return statistics.median(rates)


def bench_pool(repeats: int) -> dict[str, float]:
    pool = BlockPool(N_BLOCKS)
    pool.allocate(N_BLOCKS // 2)  # half full
    n = 20_000

    def alloc_free():
        blocks = [pool.allocate_one() for _ in range(n)]
        for b in blocks:
            pool.release(b)

    out = {"pool alloc+free pairs/s": _median_rate(alloc_free, n, repeats)}

    mgr = BlockManager([GroupSpec(None, N_BLOCKS)], 16, b"bench")
    ids = [mgr.add(None, list(range(100)))[0] for _ in range(64)]

    def append():
        for i in range(n):
            mgr.step([ids[i % 64]], [[i & 1023]])
        for s in ids:
            mgr.pop(s, n // 64)

    out["sequence append (1 token) ops/s"] = _median_rate(append, n, repeats)
    return out


def bench_lookup(repeats: int) -> dict[str, float]:
    pool = BlockPool(N_BLOCKS)
    root = root_hash(b"bench")
    keys = []
    h = root
    for b in pool.allocate(N_BLOCKS):
        h = chain_hash(h, [b] * 16)
        keys.append(h)
        pool.register(b, h)
    n = 50_000
    probe = keys[::2][:n]

    def lookup():
        for k in probe:
            pool.lookup(k)

    toks = [[i % 1000] * 16 for i in range(n)]

    def hash_lookup():
        for t in toks:
            pool.lookup(chain_hash(root, t))

    return {"prefix index probe ops/s": _median_rate(lookup, len(probe), repeats),
            "prefix block hash+probe ops/s": _median_rate(hash_lookup, n, repeats)}


def bench_step(repeats: int, steps: int, context: int = 1000, batch: int = 64) -> dict[str, float]:
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=16, kv_format="bf16",
                      block_size=16, num_blocks=N_BLOCKS, high_precision_layers=0)
    cache = PagedCache(cfg)
    ids = []
    for i in range(batch):
        new = cache.add_sequence([i] + list(range(context - 1)))
        ids.append(new.seq_id)
    cache.commit(ids)
    step_us, commit_us = [], []
    for _ in range(repeats):
        for j in range(steps):
            toks = [[j]] * batch
            t0 = time.perf_counter()
            batch_desc = cache.step(ids, toks)
            t1 = time.perf_counter()
            cache.commit(ids)
            t2 = time.perf_counter()
            step_us.append((t1 - t0) * 1e6)
            commit_us.append((t2 - t1) * 1e6)
        assert batch_desc.block_tables.shape[0] == batch
        for s in ids:
            cache.pop(s, steps)
    return {f"decode step bookkeeping, {batch} seqs x {context} ctx (us)": statistics.median(step_us),
            f"commit after the step (us)": statistics.median(commit_us)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 7
    results = {}
    results.update(bench_pool(repeats))
    results.update(bench_lookup(repeats))
    results.update(bench_step(repeats, steps=50 if args.quick else 200))
    width = max(len(k) for k in results)
    for k, v in results.items():
        print(f"{k:<{width}}  {v:>12,.1f}")
    step = next(v for k, v in results.items() if k.startswith("decode step"))
    print(f"decode step target <= 200 us: {'met' if step <= 200 else 'MISSED'} ({step:.1f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
