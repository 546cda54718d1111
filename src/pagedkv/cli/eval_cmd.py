"""`pagedkv eval`: perplexity, KL vs the bf16 cache, top-1 agreement, size and decode speed of KV
formats on a real model (default: the embedded SmolLM2 over Python's pydoc topics), offline."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import ConfigError
from .output import print_json, print_table
from .sizes import parse_bytes


def add_parser(sub) -> argparse.ArgumentParser:
    from ..eval.runner import DEFAULT_FORMATS

    p = sub.add_parser("eval", help="quality / size / speed of KV formats on a real model",
                       description=__doc__)
    p.add_argument("--model", default=None,
                   help="local HF model folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: pydoc_data.topics)")
    p.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                   help="comma-separated formats; NAME+hp adds the automatic high-precision "
                        "first/last layers, NAME+hpN N of them (default: %(default)s)")
    p.add_argument("--windows", type=int, default=8, help="windows spread over the text (default 8)")
    p.add_argument("--window-tokens", type=int, default=1024, help="tokens per window (default 1024)")
    p.add_argument("--memory", default="8GiB", help="budget for the max-context column (default 8GiB)")
    p.add_argument("--decode-steps", type=int, default=6, help="greedy steps timed per format (0 = skip)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the passes")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write KL/PPL vs bits plot")
    return p


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ..eval.model import load_model, resolve_model_source
    from ..eval.runner import EvalConfig, parse_choice
    from ..eval.text import bos_id, make_windows, read_text, tokenize

    formats = tuple(f for f in (s.strip() for s in args.formats.split(",")) if f)
    for f in formats:
        parse_choice(f)  # fail on a bad name before loading anything
    cfg = EvalConfig(model=args.model, text=args.text, formats=formats, windows=args.windows,
                     window_tokens=args.window_tokens, memory_bytes=parse_bytes(args.memory, "--memory"),
                     decode_steps=args.decode_steps)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot!r}: give a .png file name")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    source = resolve_model_source(cfg.model)
    def log(message: str) -> None:  # progress goes to stderr so that --json stays parseable
        print(message, file=sys.stderr)

    log(f"loading {source.label} ...")
    lm = load_model(source, attn_implementation="pagedkv", device=args.device)
    tokens = tokenize(lm.tokenizer, read_text(cfg.text))
    windows = make_windows(tokens, cfg.windows, cfg.window_tokens, bos_id(lm.tokenizer))
    log(f"{tokens.numel()} tokens of text; {len(windows)} windows x {cfg.window_tokens} tokens; "
        f"{len(formats)} formats")
    rows = _run_with_progress(lm.model, windows, cfg)
    elapsed = time.perf_counter() - t0
    if args.plot:
        from ..eval.plot import plot_results

        plot_results(rows, args.plot, title=f"{source.label}: {len(windows)} x {cfg.window_tokens} tokens")
    if args.json:
        print_json(rows)
    else:
        cols = ["format", "bits/elem", "KV B/token", "PPL", "KL vs bf16", "top-1", "decode tok/s",
                f"max ctx @ {args.memory}"]
        table = [[r["format"], r["bits_per_element"], r["bytes_per_token"], r["ppl"], r["kl"],
                  r["top1"], r["decode_tok_s"] if r["decode_tok_s"] else "-", r["max_context_tokens"]]
                 for r in rows]
        print_table(f"{source.label}: {len(windows)} windows x {cfg.window_tokens} tokens, "
                    f"teacher-forced on the compressed cache ({elapsed:.0f} s)", cols, table)
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


def _run_with_progress(model, windows, cfg):
    from ..eval.runner import evaluate

    total = len(windows) * len(cfg.formats)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return evaluate(model, windows, cfg)
    with tqdm(total=total, desc="eval", unit="pass", file=sys.stderr) as bar:
        def step(label):
            bar.set_postfix_str(label)
            bar.update(1)
        return evaluate(model, windows, cfg, progress=step)
