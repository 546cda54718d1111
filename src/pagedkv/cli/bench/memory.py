"""`pagedkv bench memory`: a long generation of the embedded model per format, each in its own
process; its peak resident memory above the loaded model next to the first format's, with the
KV-size difference (harness: `pagedkv.bench.memory`)."""

from __future__ import annotations

import argparse
import sys

from ...bench.config import MemoryBench
from ..output import print_json, print_table
from ..sizes import parse_count, parse_names

D = MemoryBench()


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("memory", help="peak resident memory of a long generation, per format",
                       description=__doc__)
    p.add_argument("--formats", default=",".join(D.formats),
                   help=f"KV formats, the first is the baseline (default {','.join(D.formats)})")
    p.add_argument("--memory-context", default=str(D.context),
                   help=f"tokens generated into the cache (default {D.context}; 16k works)")
    p.add_argument("--chunk", type=int, default=D.chunk, help=f"prefill chunk in tokens (default {D.chunk})")
    p.add_argument("--threads", type=int, default=D.threads, help=f"torch threads per run (default {D.threads})")
    p.add_argument("--malloc", choices=("fixed", "default"), default=D.malloc,
                   help="glibc thresholds pinned (fixed, default) or as glibc adapts them")
    p.add_argument("--no-warmup", action="store_true",
                   help="count the first use of each format's kernels (code pages) too")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows")
    return p


def run(args) -> int:
    formats = parse_names(args.formats)
    context = parse_count(args.memory_context, "--memory-context")
    from ...bench import memory

    rows = memory.compare(formats, context=context, chunk=args.chunk, threads=args.threads, malloc=args.malloc,
                          warmup=not args.no_warmup,
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
