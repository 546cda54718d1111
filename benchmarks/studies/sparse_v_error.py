"""What a sparse-V threshold skips and what it costs in error (reference ops, 1 thread).

Model-shaped heads (3 kv heads x 3 q heads, head_dim 64), K/V ~ N(0, 1), q scaled so that the
logits have standard deviation `logit_std` (1: diffuse heads, 3: peaky heads). Prints, per
context and threshold, the fraction of V rows skipped, the softmax mass dropped per head and
the relative output error (`pagedkv.ops.reference.measure_sparse_v`). bf16 cache, so the error
is the threshold's alone.

    .venv/bin/python benchmarks/studies/sparse_v_error.py [--contexts 1024,4096,16384] [--json]
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedkv.codecs import CODECS
from pagedkv.ops import AttentionParams, make_layer, store
from pagedkv.ops.reference import measure_sparse_v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--thresholds", default="1e-6,1e-4,1e-3")
    ap.add_argument("--logit-std", default="1,3")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for n in (int(c) for c in args.contexts.split(",")):
        gen = torch.Generator().manual_seed(0)
        bs = 16
        layer = make_layer(CODECS["bf16"], CODECS["bf16"], -(-n // bs), bs, 3, 64)
        store(layer, torch.randn(n, 3, 64, generator=gen), torch.randn(n, 3, 64, generator=gen), torch.arange(n))
        tables = torch.arange(layer.num_blocks, dtype=torch.int32)[None]
        lens = torch.tensor([n], dtype=torch.int32)
        for sigma in (float(s) for s in args.logit_std.split(",")):
            q = torch.randn(1, 9, 64, generator=gen) * sigma  # scale 1/8 -> logit std sigma
            for t in (float(x) for x in args.thresholds.split(",")):
                s = measure_sparse_v(q, layer, tables, lens, AttentionParams(scale=0.125, sparse_v_threshold=t))
                rows.append(dict(context=n, logit_std=sigma, threshold=t, skipped=s.skipped,
                                 dropped_mass_mean=s.dropped_mass_mean, dropped_mass_max=s.dropped_mass_max,
                                 rel_error=s.rel_error))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| context | logit std | threshold | V rows skipped | dropped mass (mean / max) | rel. error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['logit_std']:g} | {r['threshold']:g} | {r['skipped']:.1%} | "
              f"{r['dropped_mass_mean']:.3f} / {r['dropped_mass_max']:.3f} | {r['rel_error']:.3f} |")


if __name__ == "__main__":
    main()
