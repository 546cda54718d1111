"""One layer's prefill attention with a recent window: the split path against the torch fast path, side by side.

    PYTHONPATH=src python benchmarks/perf/recent_prefill_step.py [--contexts 1k,4k,8k] [--format turbo3]
        [--window r64s16q8_0] [--reps 3]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), one sequence of L tokens
prefilled at once (L queries), 16-token blocks, the tail in its own block group. Per case,
interleaved in one process, the median thread CPU time (1 torch thread) of one call, s per layer:
- no window: `ops.prefill_attention` over the pages (the C kernel);
- window, torch: `ops.recent.recent_prefill_attention` with the split turned off (the fast path
  before: every row decoded in torch, one masked SDPA per block of 128 queries);
- window, split: the same call as served (`ops.recent_prefill`: the C kernel over the pages and
  over the tail's band, torch over the sinks, merged by log-sum-exp).
The machine is shared: read the ratios, and quote the load printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recent_decode_step import D, HQ, case  # noqa: E402


def measure(fmt_name: str, window_label: str, ctx: int, reps: int) -> dict:
    from pagedkv.formats import parse_format
    from pagedkv.ops import AttentionParams, api
    from pagedkv.ops import recent as rec

    fmt, window = parse_format(fmt_name), rec.window_from_label(window_label)
    gen = torch.Generator().manual_seed(ctx)
    layer, tail, tables, tail_tables, lens, _ = case(fmt, window, ctx, 1, 16, 16, gen)
    q = torch.randn(ctx, HQ, D, generator=gen)
    qsl = torch.tensor([0, ctx], dtype=torch.int32)
    params = AttentionParams(scale=D ** -0.5)
    kw = dict(recent=window.tokens, sinks=window.sinks, tail_block_tables=tail_tables, checks=False)
    real = rec.split_prefill_applies

    def torch_path():
        rec.split_prefill_applies = lambda *a: False
        try:
            return rec.recent_prefill_attention(q, layer, tail, tables, lens, qsl, params, **kw)
        finally:
            rec.split_prefill_applies = real

    runs = {"plain": lambda: api.prefill_attention(q, layer, tables, lens, qsl, params, checks=False),
            "torch": torch_path,
            "split": lambda: rec.recent_prefill_attention(q, layer, tail, tables, lens, qsl, params, **kw)}
    times: dict = {name: [] for name in runs}
    out = {}
    for _ in range(reps):
        for name, fn in runs.items():
            t = time.thread_time()
            out[name] = fn()
            times[name].append(time.thread_time() - t)
    s = {name: statistics.median(v) for name, v in times.items()}
    return {**s, "diff": float((out["split"] - out["torch"]).abs().max()), "load": os.getloadavg()[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in (("--contexts", "1k,4k,8k"), ("--format", "turbo3"), ("--window", "r64s16q8_0")):
        p.add_argument(flag, default=default)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    from pagedkv.cli.sizes import parse_counts

    torch.set_num_threads(1)
    print(f"{args.format}+{args.window}, 16-token blocks, 1 thread, s per layer per prefill "
          f"(thread CPU time, median of {args.reps})")
    cols = ("context", "no window", "window, torch", "window, split", "torch / split", "split / no window",
            "max abs diff", "load")
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for ctx in parse_counts(args.contexts, "--contexts"):
        r = measure(args.format, args.window, ctx, args.reps)
        print(f"| {ctx:,} | {r['plain']:.3f} | {r['torch']:.3f} | {r['split']:.3f} | {r['torch'] / r['split']:.2f}x | "
              f"{r['split'] / r['plain']:.2f}x | {r['diff']:.1e} | {r['load']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
