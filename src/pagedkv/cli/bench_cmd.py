"""`pagedkv bench TARGET`: side-by-side benchmarks (targets: attention, offload, memory).

`pagedkv bench memory [--formats bf16,turbo3] [--memory-context 16k] [--chunk 256]
[--malloc fixed|default] [--json]` runs a long generation of the embedded model per format, each
in its own process, and prints its peak resident memory above the loaded model next to the first
format's, with the KV-size difference (see `pagedkv.eval.memory`).

`pagedkv bench attention [--json] [--formats ...] [--contexts 1k,4k,16k,32k] [--batch 1,8]
[--threads 1]` times one decode step of the fast CPU kernel over the compressed paged cache of
each format against the fastest torch way over a contiguous bf16 cache (see
`pagedkv.cli.bench_attention`), plus a chunked-prefill row per format and the peak memory of a
decode step at the largest context. JSON: a list of rows {"kind", "format", "context", "batch",
"ms", "baseline_ms", "ratio", "gbps", ...}, ratio = ms / baseline_ms.
"""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigError
from .output import print_json, print_table

DEFAULT_FORMATS = "bf16,fp8,turbo4,turbo3,turbo2,fp8k_turbo3v"
TARGETS = ("attention", "offload", "memory")  # offload: pagedkv.offload.bench; memory: pagedkv.eval.memory
MEMORY_FORMATS = "bf16,turbo3"


def parse_count(text: str) -> int:
    """'4k' -> 4096, '32K' -> 32768, '1000' -> 1000; ConfigError otherwise."""
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        t, mult = t[:-1], 1024
    elif t.endswith("m"):
        t, mult = t[:-1], 1024 * 1024
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise ConfigError(f"expected a count like 4096 or 4k, got {text!r}") from None
    if value < 1:
        raise ConfigError(f"expected a positive count, got {text!r}")
    return value


def parse_list(text: str) -> list[int]:
    return [parse_count(x) for x in text.split(",") if x.strip()]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="speed benchmarks, side by side with torch baselines")
    p.add_argument("target", choices=TARGETS, help="what to benchmark")
    p.add_argument("--formats", default=DEFAULT_FORMATS,
                   help=f"KV formats (default {DEFAULT_FORMATS}; memory: {MEMORY_FORMATS}, the first is the baseline)")
    p.add_argument("--contexts", default="1k,4k,16k,32k", help="context lengths (default 1k,4k,16k,32k)")
    p.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for both sides (default 1: 2-thread timings here are erratic)")
    p.add_argument("--layers", type=int, default=30, help="layers per step (default 30)")
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; medians are reported")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows")
    p.add_argument("--memory-context", default="16k", help="memory: tokens generated into the cache (default 16k)")
    p.add_argument("--chunk", type=int, default=256, help="memory: prefill chunk in tokens (default 256)")
    p.add_argument("--malloc", choices=("fixed", "default"), default="fixed",
                   help="memory: glibc thresholds pinned (fixed, default) or as glibc adapts them")
    p.add_argument("--no-warmup", action="store_true",
                   help="memory: count the first use of each format's kernels (code pages) too")
    from ..offload.bench import add_arguments as add_offload_arguments

    add_offload_arguments(p)
    from .bench_cuda import add_arguments as add_cuda_arguments  # --device cuda: Triton on a GPU

    add_cuda_arguments(p)
    return p


def _run_memory(args) -> int:
    from ..eval import memory

    chosen = MEMORY_FORMATS if args.formats == DEFAULT_FORMATS else args.formats
    formats = [f.strip() for f in chosen.split(",") if f.strip()]
    rows = memory.compare(formats, context=parse_count(args.memory_context), chunk=args.chunk,
                          threads=args.threads, malloc=args.malloc, warmup=not args.no_warmup,
                          progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    if args.json:
        print_json(rows)
        return 0
    mb = 1e6
    print_table(f"peak resident memory of the generation above the loaded model (malloc {args.malloc}, "
                f"{'no warm-up' if args.no_warmup else 'after a warm-up'}); saved and KV difference "
                f"against {rows[0]['format']}; code_mb: file-backed pages that joined the resident set",
                ["format", "tokens", "kv_mb", "peak_mb", "other_mb", "code_mb", "saved_mb", "kv_diff_mb",
                 "saved/kv_diff"],
                [[r["format"], r["tokens"], round(r["kv_pool_bytes"] / mb, 1), round(r["peak_minus_load_bytes"] / mb, 1),
                  round((r["peak_minus_load_bytes"] - r["kv_pool_bytes"]) / mb, 1), round(r["rss_file_bytes"] / mb, 1),
                  round(r["saved_bytes"] / mb, 1), round(r["kv_difference_bytes"] / mb, 1), r["saved_vs_kv"]]
                 for r in rows])
    return 0


def run(args) -> int:
    if args.target == "memory":
        return _run_memory(args)
    if args.target == "offload":
        from ..offload import bench as ob

        res = ob.run_from_args(args)
        print_json(res) if args.json else print_table(*ob.table(res))
        return 0
    if args.device == "cuda":
        from . import bench_cuda

        return bench_cuda.run(args)
    from . import bench_attention as ba

    shape = ba.BenchShape(layers=args.layers, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                          head_dim=args.head_dim, block_size=args.block_size, repeats=args.repeats,
                          threads=args.threads)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if not formats:
        raise ConfigError("--formats needs at least one KV format")
    progress = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    res = ba.run(formats, parse_list(args.contexts), parse_list(args.batch), shape,
                 prefill=not args.no_prefill, memory=not args.no_memory, progress=progress)

    mem = {(m["format"], m["context"]): m for m in res.memory}
    rows = []
    for r in res.rows:
        row = {"kind": "decode", **r, "bandwidth_gbps": res.bandwidth_gbps}
        m = mem.get((r["format"], r["context"])) if r["batch"] == 1 else None
        if m:
            row["peak_extra_mb"] = m["peak_extra_mb"]
            row["cache_mb_per_layer"] = m["cache_mb"]
            if "reference_peak_extra_mb" in m:
                row["reference_peak_extra_mb"] = m["reference_peak_extra_mb"]
        rows.append(row)
    for p in res.prefill:
        rows.append({"kind": "prefill", "batch": 1, "gbps": None, "bandwidth_gbps": res.bandwidth_gbps, **p})
    if args.json:
        print_json(rows)
        return 0

    info = res.kernel
    print(f"kernel: {info.get('variant')} (OpenMP {info.get('openmp')}), threads {shape.threads}; "
          f"measured streaming read {res.bandwidth_gbps:.1f} GB/s; shape {shape.layers} layers x "
          f"{shape.num_q_heads} q / {shape.num_kv_heads} kv heads x head_dim {shape.head_dim}; "
          f"ms per decode step over all layers (timed on a few distinct layers, scaled)")
    print_table("decode attention (ratio = ms / fastest torch bf16 way)",
                ["format", "context", "batch", "ms", "baseline_ms", "ratio", "gbps", "baseline"],
                [[r["format"], r["context"], r["batch"], r["ms"], r["baseline_ms"], r["ratio"], r["gbps"],
                  r["baseline"]] for r in res.rows])
    if res.prefill:
        print_table("chunked prefill (512 queries at the end of a 4096 context, batch 1) vs torch SDPA bf16",
                    ["format", "ms", "baseline_ms", "ratio", "baseline"],
                    [[p["format"], p["ms"], p["baseline_ms"], p["ratio"], p["baseline"]] for p in res.prefill])
    if res.memory:
        print_table("peak memory of one decode step of one layer (batch 1)",
                    ["format", "context", "cache_mb", "peak_extra_mb", "fp32_context_copy_mb",
                     "reference_peak_extra_mb"],
                    [[m["format"], m["context"], m["cache_mb"], m["peak_extra_mb"], m.get("fp32_context_copy_mb"),
                      m.get("reference_peak_extra_mb", "")] for m in res.memory])
    return 0
