"""GPU benchmark of pagedkv's Triton ops vs torch SDPA / flash-attn over a contiguous bf16 cache.

    python benchmarks/bench_attention_cuda.py              # headline: batch 32, 32k context (GPU)
    python benchmarks/bench_attention_cuda.py --json out.json --formats turbo3,bf16
    python benchmarks/bench_attention_cuda.py --dry-run    # tiny shapes on the CPU (interpreter)

The logic lives in `pagedkv.ops.triton.bench` (also behind `pagedkv bench attention --device cuda`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--context", type=int)
    ap.add_argument("--formats", help="comma-separated codec names")
    ap.add_argument("--precisions", help="comma-separated: fp32,tf32,bf16")
    ap.add_argument("--json", help="also write the result as JSON to this path")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # the edge: before Triton is imported
    import torch

    from pagedkv.ops.triton.bench import BenchConfig, format_table, run_cuda_bench

    torch.set_num_threads(1)
    cfg = BenchConfig.tiny() if args.dry_run else BenchConfig()
    over = {}
    if args.batch:
        over["batch"] = args.batch
        over["prefill_batch"] = min(cfg.prefill_batch, args.batch)
    if args.context:
        over["context"] = args.context
        over["prefill_chunk"] = min(cfg.prefill_chunk, args.context)
    if args.formats:
        over["formats"] = tuple(args.formats.split(","))
    if args.precisions:
        over["precisions"] = tuple(args.precisions.split(","))
    from dataclasses import replace

    cfg = replace(cfg, **over)
    result = run_cuda_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
