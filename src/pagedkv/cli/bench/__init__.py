"""`pagedkv bench TARGET`: side-by-side benchmarks, one sub-command per target with its own flags.

Each target is a module here defining `add_parser(sub)` (its flags, defaults taken from its
dataclass in `pagedkv.bench.config`) and `run(args)`; the harness it runs lives in
`pagedkv.bench`. Adding a target: a module here and one entry in TARGETS. Parsing imports no
torch (the harness is imported by `run`).
"""

from __future__ import annotations

import argparse
import importlib

# target -> module under pagedkv.cli.bench (help text, order of `pagedkv bench --help`)
TARGETS = {
    "attention": "attention",  # decode/prefill attention: CPU kernel (or Triton, --device cuda) vs torch bf16
    "offload": "offload",  # storage tiers: bytes and read-back time vs recomputing
    "memory": "memory",  # peak resident memory of a long generation, per format
}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="speed and memory benchmarks, side by side with baselines",
                       description=__doc__.split("\n\n")[0])
    targets = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, module in TARGETS.items():
        importlib.import_module(f"{__name__}.{module}").add_parser(targets)
    return p


def run(args) -> int:
    return importlib.import_module(f"{__name__}.{TARGETS[args.target]}").run(args)
