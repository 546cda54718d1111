"""Cache write (store) on CPU: the reference encoder vs the C store of the "cpu" backend.

Per codec, one process, one thread:
- speed: M elements/s (K and V elements written per second) of `pagedkv.ops.reference.store`
  and `pagedkv.ops.cpu.store` on the same chunk, calls interleaved (ref, C, ref, C, ...),
  medians of --repeats;
- memory: a fresh child process per (store, codec) allocates the pools of --layers layers, warms
  up with one call, then makes --calls store calls interleaved over the layers (chunk c goes to
  every layer in turn, fresh slots each time, as a chunked prefill does) and reports the growth
  of the resident set (VmRSS) and glibc's free-but-held heap (mallinfo2 fordblks) over them.
The default shape is one SmolLM2 prefill chunk: 256 tokens x 3 KV heads x head_dim 64.

    .venv/bin/python benchmarks/bench_store.py [--codecs turbo3,q8_0] [--no-memory]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _ref_store():
    return importlib.import_module("pagedkv.ops.reference.store").store


def _cpu_store():
    import pagedkv.ops.cpu as cpu

    if not cpu.available():
        raise SystemExit(f"the CPU kernel is unavailable: {cpu.kernel_info()}")
    return cpu.store


def _layer(codec_name: str, tokens: int, heads: int, head_dim: int, block_size: int = 16):
    from pagedkv.codecs.catalogue import CODECS
    from pagedkv.ops import make_layer

    codec = CODECS[codec_name]
    return make_layer(codec, codec, -(-tokens // block_size), block_size, heads, head_dim)


def speed(codec_name: str, tokens: int, heads: int, head_dim: int, repeats: int) -> dict:
    """Median M elements/s of both stores on one chunk (K and V), calls interleaved."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, heads, head_dim, generator=gen)
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    layer = _layer(codec_name, tokens, heads, head_dim)
    slots = torch.randperm(tokens, generator=gen).long()
    impls = {"reference": _ref_store(), "cpu": _cpu_store()}
    times = {name: [] for name in impls}
    for fn in impls.values():
        fn(layer, k, v, slots)  # warm-up (compiles, caches tables)
    for _ in range(repeats):
        for name, fn in impls.items():
            t = time.perf_counter()
            fn(layer, k, v, slots)
            times[name].append(time.perf_counter() - t)
    elements = 2 * k.numel()
    return {name: elements / statistics.median(ts) / 1e6 for name, ts in times.items()}


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _fordblks() -> int:
    """glibc's free bytes held in the heap (mallinfo2().fordblks); -1 without glibc >= 2.33."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return -1


def memory_child(impl: str, codec_name: str, tokens: int, heads: int, head_dim: int,
                 calls: int, layers: int) -> dict:
    """Run in a fresh process: RSS / fordblks growth over `calls` interleaved store calls."""
    torch.set_num_threads(1)
    fn = _ref_store() if impl == "reference" else _cpu_store()
    chunks = -(-calls // layers) + 1
    pools = [_layer(codec_name, tokens * chunks, heads, head_dim) for _ in range(layers)]
    for layer in pools:  # touch the pools so that their pages count before the baseline
        layer.k_pool.fill_(1)
        layer.v_pool.fill_(1)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(tokens, heads, head_dim, generator=gen)
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    fn(pools[0], k, v, torch.arange(tokens, dtype=torch.int64))  # warm-up
    rss0, free0 = _rss_bytes(), _fordblks()
    t = time.perf_counter()
    for c in range(calls):
        chunk, layer = 1 + c // layers, pools[c % layers]
        slots = torch.arange(chunk * tokens, (chunk + 1) * tokens, dtype=torch.int64)
        fn(layer, k, v, slots)
    seconds = time.perf_counter() - t
    return {"rss_growth": _rss_bytes() - rss0, "fordblks": _fordblks(), "fordblks_growth": _fordblks() - free0,
            "seconds": seconds}


def memory(impl: str, codec_name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--codecs", codec_name, "--tokens", str(args.tokens),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--calls", str(args.calls),
           "--layers", str(args.layers)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from pagedkv.codecs.catalogue import CODECS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec names")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--no-memory", action="store_true", help="skip the per-process memory runs")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=("reference", "cpu"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = [n.strip() for n in args.codecs.split(",") if n.strip()]
    if args.child:
        print(json.dumps(memory_child(args.child, names[0], args.tokens, args.heads, args.head_dim,
                                      args.calls, args.layers)))
        return 0

    rows = []
    for name in names:
        row = {"codec": name, **{f"{k}_meps": v for k, v in speed(name, args.tokens, args.heads,
                                                                   args.head_dim, args.repeats).items()}}
        if not args.no_memory:
            for impl in ("reference", "cpu"):
                m = memory(impl, name, args)
                row[f"{impl}_rss_mb"] = m["rss_growth"] / 2**20
                row[f"{impl}_fordblks_mb"] = m["fordblks"] / 2**20
        rows.append(row)
        if not args.json:
            line = (f"| {name} | {row['reference_meps']:.1f} | {row['cpu_meps']:.1f} | "
                    f"{row['cpu_meps'] / row['reference_meps']:.1f} |")
            if not args.no_memory:
                line += (f" {row['reference_rss_mb']:+.1f} | {row['cpu_rss_mb']:+.1f} | "
                         f"{row['reference_fordblks_mb']:.1f} | {row['cpu_fordblks_mb']:.1f} |")
            if len(rows) == 1:
                head = "| codec | reference M el/s | C M el/s | speedup |"
                sep = "|---|---|---|---|"
                if not args.no_memory:
                    head += f" ref dRSS MB ({args.calls} calls) | C dRSS MB | ref heap free MB | C heap free MB |"
                    sep += "---|---|---|---|"
                print(f"shape: {args.tokens} tokens x {args.heads} kv heads x head_dim {args.head_dim}, "
                      f"K and V, 1 thread, medians of {args.repeats}")
                print(head)
                print(sep)
            print(line, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
