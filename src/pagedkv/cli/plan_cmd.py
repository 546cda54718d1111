"""`pagedkv plan`: how many tokens / sequences fit in a memory budget, per KV format, from the
exact catalogue sizes and the model's layer layout (its config only; no weights are loaded; a
GGUF's metadata is read without its tensors or tokenizer)."""

from __future__ import annotations

import argparse
import os

from ..defaults import BLOCK_SIZE
from .output import print_json, print_table
from .sizes import parse_bytes, parse_names


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="tokens / sequences that fit in a memory budget", description=__doc__)
    p.add_argument("--model", default=None, help="local HF model folder or .gguf (default: embedded SmolLM2)")
    p.add_argument("--memory", default="8GiB", help="KV budget (default 8GiB)")
    p.add_argument("--formats", "--format", action="append", default=None, dest="formats",
                   help="comma-separated formats (NAME+hp for high-precision layers; the flag may repeat); "
                        "default: a standard list")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length for the sequences column "
                   "(default: the model's max_position_embeddings)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"default {BLOCK_SIZE}")
    p.add_argument("--json", action="store_true")
    return p


def run(args) -> int:
    memory = parse_bytes(args.memory, "--memory")
    formats = parse_names(",".join(args.formats)) if args.formats else None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..eval.model import load_config, resolve_model_source
    from ..eval.plan import DEFAULT_PLAN_FORMATS, plan

    source = resolve_model_source(args.model)
    config = load_config(source)
    rows = plan(config, memory, formats or DEFAULT_PLAN_FORMATS, seq_len=args.seq_len,
                block_size=args.block_size)
    if args.json:
        print_json(rows)
        return 0
    seq_len = rows[0]["seq_len"] if rows else args.seq_len
    print_table(f"{source.label}: {rows[0]['layers']} layers, KV budget {args.memory}" if rows else "plan",
                ["format", "bits/elem", "KV B/token", "tokens", f"seqs of {seq_len}", "vs bf16"],
                [[r["format"], r["bits_per_element"], f"{r['bytes_per_token']:g}", r["tokens"], r["sequences"],
                  f"{r['vs_bf16']:.2f}x"] for r in rows])
    return 0
