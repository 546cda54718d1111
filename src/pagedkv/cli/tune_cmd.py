"""`pagedkv tune`: write a per-layer K/V codec plan for a model within an average-bits budget."""

from __future__ import annotations

import os
import sys


def add_parser(sub):
    p = sub.add_parser("tune", help="per-layer K/V codec plan within a bits budget (plan.json is a KV format)",
                       description=__doc__ + " The plan file is accepted wherever a KV format is "
                       "(`pagedkv eval --formats plan.json`, `PagedKVCache(model, 'plan.json')`).")
    p.add_argument("--model", default=None, help="local HF model folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--bits", type=float, required=True, help="average stored bits per K/V element")
    p.add_argument("--text", default=None, help="calibration text file (default: standard-library docstrings; "
                   "never the eval text)")
    p.add_argument("--tokens", type=int, default=512, help="calibration tokens (default 512)")
    p.add_argument("--recent", default=None, metavar="R[CODEC]",
                   help="add a recent window of R tokens (e.g. 64 or 64q8_0), counted in the budget")
    p.add_argument("--context", type=int, default=1024, help="tokens at which the recent window is counted")
    p.add_argument("--out", required=True, help="plan file to write (.json)")
    return p


def run(args) -> int:
    import re

    from ..errors import ConfigError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.out.lower().endswith(".json"):
        raise ConfigError(f"--out must name a .json file, got {args.out!r}")
    if not args.bits > 0 or args.tokens < 2 or args.context < 1:
        raise ConfigError("--bits must be > 0, --tokens >= 2 and --context >= 1")
    recent = None
    if args.recent is not None:
        m = re.match(r"^(\d+)([a-z0-9_]*)$", args.recent.strip().lower())
        if not m:
            raise ConfigError(f"--recent must be R or R<codec> (e.g. 64q8_0), got {args.recent!r}")
        from ..ops.recent import RecentWindow

        recent = RecentWindow(int(m[1]), m[2] or "bf16")
    text = None
    if args.text is not None:
        from ..eval.text import read_text

        text = read_text(args.text)
    from ..eval.model import load_model, load_tokenizer, resolve_model_source
    from ..tune import tune
    from ..tune.choose import write_plan

    source = resolve_model_source(args.model)
    tokenizer = load_tokenizer(source)
    lm = load_model(source, attn_implementation="sdpa", tokenizer=tokenizer)
    doc = tune(lm.model, tokenizer, bits=args.bits, text=text, tokens=args.tokens, recent=recent,
               context=args.context, label=source.label)
    write_plan(args.out, doc)
    names = [f"{e['k']}/{e['v']}" for e in doc["layers"]]
    print(f"{args.out}: {len(names)} layers, {doc['bits_per_element']:.3f} bits/element (K/V pages): "
          + " ".join(names), file=sys.stdout)
    return 0
