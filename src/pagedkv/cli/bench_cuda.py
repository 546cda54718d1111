"""`pagedkv bench attention --device cuda [--json] [--dry-run]`: the GPU side of the bench.

Runs `pagedkv.ops.triton.bench` (Triton kernels vs torch SDPA / flash-attn over a contiguous
bf16 cache, headline batch 32 x 32k context, Llama-3-8B heads) in one process. --formats and
--json are shared with the CPU bench; --batch / --contexts override the headline shape only
when given explicitly (their CPU defaults do not apply here); q/kv heads and head_dim are
32 / 8 / 128. --dry-run runs the same logic on tiny shapes on the CPU under Triton's interpreter
(no GPU needed; the times mean nothing). Importing this module does not import Triton.
"""

from __future__ import annotations

import os
import sys

from .output import print_json, print_table


def add_arguments(p) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the fast CPU kernel (default); cuda: the Triton kernels on the GPU")
    p.add_argument("--precisions", default="fp32,bf16",
                   help="cuda: matmul operand precisions of our kernels, of fp32,tf32,bf16 (default fp32,bf16)")
    p.add_argument("--dry-run", action="store_true",
                   help="cuda: tiny shapes on the CPU under TRITON_INTERPRET=1, to check the script")


def _explicit(args, name: str, default) -> bool:
    return getattr(args, name, default) != default


def run(args) -> int:
    from .bench_cmd import DEFAULT_FORMATS, parse_list

    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # the edge: before Triton is first imported
    from dataclasses import replace

    from ..ops.triton.bench import BenchConfig, run_cuda_bench

    cfg = BenchConfig.tiny() if args.dry_run else BenchConfig()
    over = {"precisions": tuple(x.strip() for x in args.precisions.split(",") if x.strip())}
    if not args.dry_run or _explicit(args, "formats", DEFAULT_FORMATS):
        over["formats"] = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    if _explicit(args, "batch", "1,8"):
        over["batch"] = max(parse_list(args.batch))
        over["prefill_batch"] = min(cfg.prefill_batch, over["batch"])
    if _explicit(args, "contexts", "1k,4k,16k,32k"):
        over["context"] = max(parse_list(args.contexts))
        over["prefill_chunk"] = min(cfg.prefill_chunk, over["context"])
    cfg = replace(cfg, **over)
    progress = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    res = run_cuda_bench(cfg, log=progress or (lambda s: None))
    if args.json:
        print_json(res)
        return 0
    head = f"{res['device']}"
    if res.get("peak_bandwidth"):
        head += f"; spec peak {res['peak_bandwidth'] / 1e12:.2f} TB/s"
    if res.get("copy_bandwidth"):
        head += f"; measured copy {res['copy_bandwidth'] / 1e12:.2f} TB/s"
    print(f"{head}; batch {cfg.batch} x context {cfg.context}, {cfg.num_q_heads} q / {cfg.num_kv_heads} kv "
          f"heads x {cfg.head_dim}; prefill: {cfg.prefill_batch} x {cfg.prefill_chunk} new tokens at the end")
    cols = ["op", "impl", "format", "precision", "ms", "speedup_vs_sdpa", "gbps", "frac_peak", "tflops",
            "store_over_prefill", "rel_err_vs_sdpa"]
    print_table("GPU attention (speedup = SDPA bf16 ms / ms; bandwidth on the bytes each side reads)",
                cols, [[r.get(c, "") for c in cols] for r in res["rows"]])
    return 0
