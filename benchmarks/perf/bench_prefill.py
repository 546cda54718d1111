"""Chunked prefill on CPU: the prefill tile vs the general kernel, each against torch SDPA over bf16.

One process, one thread, the embedded model's shape (9 q heads, 3 kv heads, head_dim 64, block
size 16; ms per 30-layer step). Per (format, shape) `pagedkv.bench.attention.prefill_row` times
the C kernel interleaved with torch SDPA over a contiguous bf16 cache with the same bottom-right
causal mask (thread CPU time, medians), once with the prefill tile (`pkv_prefill`, the default)
and once on the general kernel (`run_attention(prefill_tile=False)`); the 1-minute load is
printed beside every row. Shapes: "CONTEXT:QUERIES" (q_len queries at the end of the context).

    PYTHONPATH=src .venv/bin/python benchmarks/perf/bench_prefill.py [--formats turbo3,turbo4,fp8k_turbo3v]
        [--shapes 4096:512,16384:2048] [--repeats 3] [--no-general] [--threads 1] [--bf16]

--bf16 adds a row for the tile with bf16 products (`AttentionParams.bf16_dots`; AVX-512 BF16
builds, elsewhere that row is the exact tile).
--threads N > 1 times wall clock (thread CPU time counts one thread only); SDPA then runs on N
threads too (torch.set_num_threads), so the ratio compares like with like.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch

from pagedkv.bench.attention import prefill_row
from pagedkv.bench.config import BenchShape
from pagedkv.formats import parse_format
from pagedkv.ops import cpu
from pagedkv.ops.cpu.attention import run_attention


def _run(kernel, tile: bool, bf16: bool, q, layer, tables, lens, qsl, params, **kw):
    if bf16:
        params = dataclasses.replace(params, bf16_dots=True)
    return run_attention(kernel, q, layer, tables, lens, qsl, params, prefill_tile=tile, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="turbo3,turbo4,fp8k_turbo3v")
    ap.add_argument("--shapes", default="4096:512,16384:2048", help="CONTEXT:QUERIES, comma separated")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (prefill_row takes 2-3)")
    ap.add_argument("--no-general", action="store_true", help="skip the general kernel's prefill")
    ap.add_argument("--threads", type=int, default=1, help="threads of both (> 1: wall-clock times)")
    ap.add_argument("--bf16", action="store_true", help="also the tile with bf16 products (bf16_dots)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = BenchShape(repeats=args.repeats, threads=args.threads)
    kernel = cpu._require()
    paths = ([("tile", True, False)] + ([("bf16", True, True)] if args.bf16 else [])
             + ([] if args.no_general else [("general", False, False)]))
    for spec in args.shapes.split(","):
        context, q_len = (int(x) for x in spec.split(":"))
        for fmt in args.formats.split(","):
            for label, tile, bf16 in paths:
                fn = functools.partial(_run, kernel, tile, bf16)
                r = prefill_row(parse_format(fmt), shape, context, q_len, fn)
                print(f"{q_len} after {context - q_len}: {fmt:>13} {label:>7} {r['ms']:8.0f} ms vs sdpa "
                      f"{r['baseline_ms']:8.0f} ms ratio {r['ratio']:.2f} ({args.threads} thread{'s' * (args.threads > 1)}, "
                      f"load {r['load']:.1f})", flush=True)


if __name__ == "__main__":
    main()
