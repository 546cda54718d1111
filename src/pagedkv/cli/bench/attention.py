"""`pagedkv bench attention`: one decode step of attention over the compressed paged cache of each
format against the fastest torch way over a contiguous bf16 cache, side by side in one process.

--device cpu (default): the fast CPU kernel on the embedded model's shape, a grid of contexts x
batch sizes, a chunked-prefill row per format and the peak memory of a decode step at the largest
context (harness: `pagedkv.bench.attention`). JSON: a list of rows {"kind", "format", "context",
"batch", "ms", "baseline_ms", "ratio", "gbps", ...}, ratio = ms / baseline_ms.

--device cuda: the Triton kernels vs torch SDPA / flash-attn (headline batch 32 x 32k context,
Llama-3-8B heads 32 q / 8 kv x 128; --batch / --contexts override it with their largest value;
harness: `pagedkv.bench.attention_cuda`). --dry-run runs the same logic on tiny shapes on the CPU
under Triton's interpreter (no GPU needed; the times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

from ...bench.config import AttentionBench, BenchConfig, BenchShape
from ...errors import ConfigError
from ..output import print_json, print_table
from ..sizes import parse_count, parse_counts, parse_names

SHAPE, CPU, CUDA = BenchShape(), AttentionBench(), BenchConfig()


def _csv(values) -> str:
    return ",".join(f"{v // 1024}k" if isinstance(v, int) and v >= 1024 and v % 1024 == 0 else str(v)
                    for v in values)


def _shapes(shapes) -> str:
    return ",".join(f"{_csv([c])}:{_csv([q])}" for c, q in shapes)


def parse_prefill_shapes(text: str) -> list[tuple[int, int]]:
    """"4k:512,16k:2k" -> [(4096, 512), (16384, 2048)]; ConfigError naming the bad item."""
    shapes = []
    for item in (text or "").split(","):
        parts = item.strip().split(":")
        if len(parts) != 2:
            raise ConfigError(f"--prefill-shapes: {item.strip()!r} is not CONTEXT:QUERIES (e.g. 4k:512)")
        context, q_len = (parse_count(x.strip(), "--prefill-shapes") for x in parts)
        if not 1 <= q_len <= context:
            raise ConfigError(f"--prefill-shapes: {item.strip()!r} needs 1 <= QUERIES <= CONTEXT")
        shapes.append((context, q_len))
    return shapes


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("attention", help="decode/prefill attention vs torch over bf16 (CPU kernel or Triton)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: the fast CPU kernel (default); cuda: the Triton kernels on a GPU")
    p.add_argument("--formats", default=None,
                   help=f"KV formats (default cpu: {','.join(CPU.formats)}; cuda: {','.join(CUDA.formats)})")
    p.add_argument("--contexts", default=None,
                   help=f"context lengths (default cpu: {_csv(CPU.contexts)}; cuda: {_csv([CUDA.context])})")
    p.add_argument("--batch", default=None,
                   help=f"batch sizes (default cpu: {_csv(CPU.batches)}; cuda: {CUDA.batch})")
    p.add_argument("--json", action="store_true", help="print a JSON list of rows (cuda: a JSON object)")
    cpu = p.add_argument_group("--device cpu")
    cpu.add_argument("--threads", type=int, default=SHAPE.threads,
                     help=f"CPU threads for both sides (default {SHAPE.threads}: 2-thread timings here are erratic)")
    cpu.add_argument("--layers", type=int, default=SHAPE.layers, help=f"layers per step (default {SHAPE.layers})")
    cpu.add_argument("--q-heads", type=int, default=SHAPE.num_q_heads, help=f"default {SHAPE.num_q_heads}")
    cpu.add_argument("--kv-heads", type=int, default=SHAPE.num_kv_heads, help=f"default {SHAPE.num_kv_heads}")
    cpu.add_argument("--head-dim", type=int, default=SHAPE.head_dim, help=f"default {SHAPE.head_dim}")
    cpu.add_argument("--block-size", type=int, default=SHAPE.block_size, help=f"default {SHAPE.block_size}")
    cpu.add_argument("--repeats", type=int, default=SHAPE.repeats,
                     help=f"timed repeats; medians are reported (default {SHAPE.repeats})")
    cpu.add_argument("--no-prefill", action="store_true", help="skip the prefill rows")
    cpu.add_argument("--prefill-shapes", default=_shapes(CPU.prefill_shapes), metavar="CONTEXT:QUERIES,...",
                     help="chunked-prefill rows: QUERIES new tokens at the end of a CONTEXT-token sequence "
                          f"(default {_shapes(CPU.prefill_shapes)}; the issue's pair: 4k:512,16k:2k)")
    cpu.add_argument("--no-decode", action="store_true", help="skip the decode grid (prefill / scaling rows only)")
    cpu.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    cpu.add_argument("--int8-scores", action="store_true",
                     help="decode rows also with the approximate integer q.k (AttentionParams.int8_scores)")
    cpu.add_argument("--bf16-dots", action="store_true",
                     help="decode rows also with bf16 products (AttentionParams.bf16_dots: bf16 and fp8 E4M3 "
                          "keys on AVX-512 BF16 builds; other keys compute exactly), scores \"bf16\"")
    cpu.add_argument("--scaling-threads", type=int, default=None, metavar="N",
                     help="also time our kernel at 1 and N threads, interleaved (wall clock), per format, "
                          "context and batch: the multi-thread speed-up, with the machine load beside it")
    gpu = p.add_argument_group("--device cuda")
    gpu.add_argument("--precisions", default=",".join(CUDA.precisions),
                     help=f"matmul operand precisions of our kernels, of fp32,tf32,bf16 (default "
                          f"{','.join(CUDA.precisions)})")
    gpu.add_argument("--dry-run", action="store_true",
                     help="tiny shapes on the CPU under TRITON_INTERPRET=1, to check the script")
    return p


def run(args) -> int:
    if args.device == "cuda":
        return _run_cuda(args)
    shape = replace(SHAPE, layers=args.layers, num_q_heads=args.q_heads, num_kv_heads=args.kv_heads,
                    head_dim=args.head_dim, block_size=args.block_size, repeats=args.repeats,
                    threads=args.threads)
    shape.check()
    formats = parse_names(args.formats) if args.formats is not None else list(CPU.formats)
    contexts = parse_counts(args.contexts, "--contexts") if args.contexts is not None else list(CPU.contexts)
    batches = parse_counts(args.batch, "--batch") if args.batch is not None else list(CPU.batches)
    prefill_shapes = parse_prefill_shapes(args.prefill_shapes)
    _check_memory(formats, contexts, batches, shape)
    from ...bench import attention as ba

    progress = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    res = ba.run(formats, contexts, batches, shape, prefill=CPU.prefill and not args.no_prefill,
                 memory=CPU.memory and not args.no_memory, progress=progress, int8_scores=args.int8_scores,
                 bf16_dots=args.bf16_dots, scaling_threads=args.scaling_threads, prefill_shapes=tuple(prefill_shapes),
                 decode=not args.no_decode)

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
    for s in res.scaling:
        rows.append({"kind": "scaling", **s})
    if args.json:
        print_json(rows)
        return 0

    info = res.kernel
    print(f"kernel: {info.get('variant')} (OpenMP {info.get('openmp')}), threads {shape.threads}; "
          f"measured streaming read {res.bandwidth_gbps:.1f} GB/s; shape {shape.layers} layers x "
          f"{shape.num_q_heads} q / {shape.num_kv_heads} kv heads x head_dim {shape.head_dim}; "
          f"ms per decode step over all layers (timed on a few distinct layers, scaled)")
    if res.rows:
        print_table("decode attention (ratio = ms / fastest torch bf16 way)",
                    ["format", "scores", "context", "batch", "ms", "baseline_ms", "ratio", "gbps", "baseline"],
                    [[r["format"], r["scores"], r["context"], r["batch"], r["ms"], r["baseline_ms"], r["ratio"],
                      r["gbps"], r["baseline"]] for r in res.rows])
    if res.prefill:
        print_table("chunked prefill (queries at the end of the context, batch 1) vs torch SDPA bf16",
                    ["format", "context", "queries", "ms", "baseline_ms", "ratio", "baseline", "load"],
                    [[p["format"], p["context"], p["q_len"], p["ms"], p["baseline_ms"], p["ratio"], p["baseline"],
                      p["load"]] for p in res.prefill])
    if res.scaling:
        print_table("thread scaling of our kernel (speedup = ms at 1 thread / ms at N threads, wall clock)",
                    ["format", "context", "batch", "threads", "ms_1", "ms_n", "speedup", "load_before", "load"],
                    [[s["format"], s["context"], s["batch"], s["threads"], s["ms_1"], s["ms_n"], s["speedup"],
                      s["load_before"], s["load"]] for s in res.scaling])
    if res.memory:
        print_table("peak memory of one decode step of one layer (batch 1)",
                    ["format", "context", "cache_mb", "peak_extra_mb", "fp32_context_copy_mb",
                     "reference_peak_extra_mb"],
                    [[m["format"], m["context"], m["cache_mb"], m["peak_extra_mb"], m.get("fp32_context_copy_mb"),
                      m.get("reference_peak_extra_mb", "")] for m in res.memory])
    return 0


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (Linux MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_memory(formats, contexts, batches, shape) -> None:
    """Refuse a grid whose largest point cannot fit before allocating any of it: at that point
    one layer of the bf16 baseline cache and one layer of every format are alive together (the
    harness times more layers only within its memory budget)."""
    from ...formats import parse_format

    fmts = [parse_format(f) for f in formats]
    tokens = max(contexts) * max(batches)
    h, d = shape.num_kv_heads, shape.head_dim
    need = tokens * h * (2 * 2 * d + sum(f.k.row_bytes(d) + f.v.row_bytes(d) for f in fmts))
    have = available_memory()
    if have is not None and need > 0.8 * have:
        raise ConfigError(f"--contexts {max(contexts)} x --batch {max(batches)} needs at least "
                          f"{need / 2**30:.1f} GiB for one layer of the bf16 baseline and of each format; "
                          f"{have / 2**30:.1f} GiB is available: give smaller --contexts or --batch")


def _run_cuda(args) -> int:
    cfg = BenchConfig.tiny() if args.dry_run else CUDA
    over = {"precisions": tuple(parse_names(args.precisions, "--precisions"))}
    if args.formats is not None:
        over["formats"] = tuple(parse_names(args.formats))
    if args.batch is not None:
        over["batch"] = max(parse_counts(args.batch, "--batch"))
        over["prefill_batch"] = min(cfg.prefill_batch, over["batch"])
    if args.contexts is not None:
        over["context"] = max(parse_counts(args.contexts, "--contexts"))
        over["prefill_chunk"] = min(cfg.prefill_chunk, over["context"])
    cfg = replace(cfg, **over)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # the edge: before Triton is first imported
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ConfigError("--device cuda needs Triton (pip install triton); it is not installed") from None
    from ...bench.attention_cuda import run_cuda_bench

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
