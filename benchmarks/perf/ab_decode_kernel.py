"""A/B of two builds of the C attention kernel in one process: decode attention, interleaved.

The "old" build compiles the kernel sources of a git revision (default HEAD) with the same flags as
this checkout's build; the "new" build is this checkout's (`pagedkv.ops.cpu`). Both run the same
pools, block tables and queries (`pagedkv.bench.attention`'s seeded layers, SmolLM2 shape), one
after the other within each repeat, timed by the calling thread's CPU time (1 thread); the script
prints per-layer medians, the new / old ratio and the largest output difference between the builds.

    PYTHONPATH=src python benchmarks/perf/ab_decode_kernel.py --formats turbo3,turbo4,fp8k_turbo3v \
        --context 32768 --batch 1,8 --repeats 9 [--old-rev HEAD]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.bench.attention import _seeded_layers, _timed_layers, layer_bytes, machine_load
from pagedkv.bench.config import BenchShape
from pagedkv.formats import parse_format
from pagedkv.ops import AttentionParams
from pagedkv.ops import cpu as cpu_ops
from pagedkv.ops.cpu import build
from pagedkv.ops.cpu.attention import run_attention


def old_kernel(rev: str, variant: str, defines: list) -> build.LoadedKernel:
    """The kernel sources of `rev` ("." = this checkout's files) compiled with extra `defines` into a
    private temporary directory and loaded."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    rel = build.SOURCE.parent.relative_to(root)
    tmp = Path(tempfile.mkdtemp(prefix="pkv-ab-"))
    for src in (*build.SOURCES, *build.HEADERS):
        data = (src.read_bytes() if rev == "." else
                subprocess.check_output(["git", "-C", str(root), "show", f"{rev}:{rel / src.name}"]))
        (tmp / src.name).write_bytes(data)
    cc = build.find_compiler()
    out = tmp / "old.so"
    ok, err = build._compile(cc, build._flags(variant, True) + list(defines), out,
                             sources=[tmp / s.name for s in build.SOURCES])
    if not ok:
        raise SystemExit(f"compiling the old kernel failed: {err}")
    lib = ctypes.CDLL(str(out))
    cpu_ops.bind(lib)
    return build.LoadedKernel(lib, str(out), variant, True, cc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="turbo3,turbo4,fp8k_turbo3v")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--layers", type=int, default=0,
                    help="distinct layers timed back to back per repeat (0: as `pagedkv bench attention`, "
                         "> 4x the L3 cache, so that the reads come from DRAM)")
    ap.add_argument("--inner", type=int, default=1, help="calls per layer per timing (short contexts)")
    ap.add_argument("--old-rev", default="HEAD", help='git revision of the "old" build ("." = this checkout)')
    ap.add_argument("--old-define", action="append", default=[], help="-D flag for the old build, e.g. PKV_LUT8=0")
    args = ap.parse_args()
    torch.set_num_threads(1)
    new = cpu_ops.load()
    old = old_kernel(args.old_rev, new.variant, [f"-D{d}" for d in args.old_define])
    shape = BenchShape()
    print(f"variant {new.variant}; old = {args.old_rev} {' '.join(args.old_define)}, new = working tree; "
          f"load {machine_load():.2f}")
    for fname in args.formats.split(","):
        fmt = parse_format(fname)
        for batch in (int(b) for b in args.batch.split(",")):
            bs = shape.block_size
            per_seq = -(-args.context // bs)
            nb = per_seq * batch
            nl = args.layers or _timed_layers(shape, layer_bytes(fmt, shape, args.context * batch))
            layers = _seeded_layers(fmt, shape, nb, nl, huge_pages=True)
            gen = torch.Generator().manual_seed(11)
            tables = torch.randperm(nb, generator=gen).to(torch.int32).reshape(batch, per_seq)
            lens = torch.full((batch,), args.context, dtype=torch.int32)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            q = torch.randn(batch, shape.num_q_heads, shape.head_dim, generator=gen).to(torch.bfloat16)
            params = AttentionParams(scale=shape.head_dim ** -0.5)

            def run(k, i):
                return run_attention(k, q, layers[i], tables, lens, qsl, params, num_threads=1)

            diff = max(float((run(old, i).float() - run(new, i).float()).abs().max()) for i in range(nl))
            times = {"old": [], "new": []}
            for r in range(args.repeats):
                for name, k in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
                    t = time.thread_time()
                    for i in range(nl):
                        for _ in range(args.inner):
                            run(k, i)
                    times[name].append((time.thread_time() - t) / (nl * args.inner))
            mo, mn = statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3
            gbs = layer_bytes(fmt, shape, args.context * batch) / (mn * 1e-3) / 1e9
            print(f"{fname:>14} b{batch}: old {mo:7.3f} ms  new {mn:7.3f} ms  new/old {mn / mo:.3f}  "
                  f"(per layer, {nl} layers, median of {args.repeats}; new {gbs:.2f} GB/s; max |diff| {diff:.2e}; "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)
            del layers


if __name__ == "__main__":
    main()
