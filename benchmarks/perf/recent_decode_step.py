"""One layer's decode attention with a recent window: the split path against the torch path, side by side.

    PYTHONPATH=src python benchmarks/perf/recent_decode_step.py [--contexts 300,1k,4k,16k] [--batches 1,8]
        [--format turbo3] [--window r64s16q8_0] [--page-block 32] [--tail-block 32] [--reps 7]

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64), B sequences of L cached
tokens each (the query at L - 1), the format's pages plus the window's tail in its own block
group (own tables, vLLM's layout; vLLM with a window uses 32-token blocks). Per case, interleaved
in one process, the median thread CPU time (1 torch thread) of one call, ms per layer per decode
step:
- no window: `ops.decode_attention` over the pages (the C kernel);
- window, torch: `ops.recent.recent_decode_attention` with the split turned off (the path every
  decode step ran before: every page row decoded in torch);
- window, split: the same call as served (`ops.recent_decode`: the C kernel over the pages keys,
  torch over the S + R tail rows, merged by log-sum-exp).
The machine is shared: read the ratios, and quote the load printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))

HQ, H, D = 9, 3, 64


def case(fmt, window, ctx: int, batch: int, page_block: int, tail_block: int, gen: torch.Generator):
    from pagedkv.cache.storage import build_tail
    from pagedkv.ops import api, make_layer

    per_p, per_t = -(-ctx // page_block), -(-ctx // tail_block)
    layer = make_layer(fmt.k, fmt.v, per_p * batch, page_block, H, D)
    tail = build_tail(make_layer(fmt.k, fmt.v, 1, tail_block, H, D), window.codec, per_t * batch)
    tables = torch.randperm(per_p * batch, generator=gen).to(torch.int32).view(batch, per_p).contiguous()
    tail_tables = torch.randperm(per_t * batch, generator=gen).to(torch.int32).view(batch, per_t).contiguous()
    pos = torch.arange(ctx)
    for b in range(batch):  # the same K/V in both (a tail row is the window's copy of the token)
        k = torch.randn(ctx, H, D, generator=gen) + 0.5
        v = torch.randn(ctx, H, D, generator=gen)
        api.store(layer, k, v, tables[b, pos // page_block].long() * page_block + pos % page_block, checks=False)
        api.store(tail, k, v, tail_tables[b, pos // tail_block].long() * tail_block + pos % tail_block, checks=False)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, HQ, D, generator=gen)
    return layer, tail, tables, tail_tables, lens, q


def measure(fmt_name: str, window_label: str, ctx: int, batch: int, args) -> dict:
    from pagedkv.formats import parse_format
    from pagedkv.ops import AttentionParams, api
    from pagedkv.ops import recent as rec

    fmt, window = parse_format(fmt_name), rec.window_from_label(window_label)
    gen = torch.Generator().manual_seed(ctx * 31 + batch)
    layer, tail, tables, tail_tables, lens, q = case(fmt, window, ctx, batch, args.page_block, args.tail_block, gen)
    params = AttentionParams(scale=D ** -0.5)
    kw = dict(recent=window.tokens, sinks=window.sinks, tail_block_tables=tail_tables, checks=False)
    real = rec.split_applies

    def plain():
        api.decode_attention(q, layer, tables, lens, params, checks=False)

    def torch_path():
        rec.split_applies = lambda *a: False
        try:
            rec.recent_decode_attention(q, layer, tail, tables, lens, params, **kw)
        finally:
            rec.split_applies = real

    def split():
        rec.recent_decode_attention(q, layer, tail, tables, lens, params, **kw)

    runs = {"plain": plain, "torch": torch_path, "split": split}
    times = {name: [] for name in runs}
    for _ in range(args.reps + 1):  # the first round warms up, not timed
        for name, fn in runs.items():
            t = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t)
    ms = {name: 1e3 * statistics.median(v[1:]) for name, v in times.items()}
    # the split must compute what the torch path does (fp32 rounding)
    rec.split_applies = lambda *a: False
    want = rec.recent_decode_attention(q, layer, tail, tables, lens, params, **kw)
    rec.split_applies = real
    err = float((rec.recent_decode_attention(q, layer, tail, tables, lens, params, **kw) - want).abs().max())
    return {"context": ctx, "batch": batch, **{f"{k}_ms": v for k, v in ms.items()},
            "torch_over_split": ms["torch"] / ms["split"], "split_over_plain": ms["split"] / ms["plain"],
            "max_abs_diff": err, "load_1min": os.getloadavg()[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="300,1k,4k,16k")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--format", default="turbo3")
    p.add_argument("--window", default="r64s16q8_0", help="a window label (default %(default)s)")
    p.add_argument("--page-block", type=int, default=32)
    p.add_argument("--tail-block", type=int, default=32)
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args(argv)
    from pagedkv.cli.sizes import parse_counts

    torch.set_num_threads(1)
    print(f"{args.format}+{args.window}, pages block {args.page_block}, tail block {args.tail_block}, "
          f"1 thread, ms per layer per decode step (thread CPU time, median of {args.reps})")
    print("| context | batch | no window | window, torch | window, split | torch / split | split / no window "
          "| max abs diff | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for ctx in parse_counts(args.contexts, "--contexts"):
        for batch in (int(b) for b in args.batches.split(",")):
            r = measure(args.format, args.window, ctx, batch, args)
            print(f"| {ctx:,} | {batch} | {r['plain_ms']:.2f} | {r['torch_ms']:.2f} | {r['split_ms']:.2f} | "
                  f"{r['torch_over_split']:.1f}x | {r['split_over_plain']:.2f}x | {r['max_abs_diff']:.1e} | "
                  f"{r['load_1min']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
