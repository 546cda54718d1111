"""Long-window KL of KV formats (issue 33), one format at a time, each row written as soon as it is done.

    PYTHONPATH=src python benchmarks/studies/long_window_kl.py --window-tokens 8192 --windows 1 \\
        --formats bf16,turbo3,turbo3k_turbo2v+r32s16q8_0 --out smol8k.jsonl [--model gemma3-270m]

The numbers `pagedkv eval --window-tokens N --windows W --formats ... --json` prints (the same
windows of the default text, the same passes and metrics: `runner._forward`,
`metrics.hidden_window_sums`, `runner.format_result`), computed format by format: each format's
row (the eval's JSON row plus `seconds`, the CPU time of its passes) is appended to --out as soon
as its windows are done, and the bf16 reference's final hidden states are kept beside it
(--out + `.ref<i>.pt`), so a run cut short keeps what it finished, and a format added later (a
tuned plan) costs no second reference pass. Formats already in --out are skipped. `--show` prints
the table of --out by position bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))


def load(model_arg, window_tokens: int, windows: int):
    from pagedkv.eval.model import load_model, load_tokenizer, resolve_model_source
    from pagedkv.eval.text import bos_id, default_text, make_windows, tokenize
    from pagedkv.integrations.transformers import enable

    source = resolve_model_source(model_arg)
    tokenizer = load_tokenizer(source)
    wins = make_windows(tokenize(tokenizer, default_text()), windows, window_tokens, bos_id(tokenizer))
    lm = load_model(source, attn_implementation="pagedkv", tokenizer=tokenizer)
    enable(lm.model)
    return lm.model, tokenizer, wins, source.label


def done_labels(path: str) -> set:
    if not os.path.exists(path):
        return set()
    with open(path, encoding="utf-8") as f:
        return {json.loads(line)["format"] for line in f if line.strip()}


def reference(model, window, cfg, path: str) -> torch.Tensor:
    """The bf16 reference's final hidden states [L - 1, H] of `window`, from `path` when kept."""
    from pagedkv.eval.runner import REFERENCE_FORMAT, _forward, parse_choice

    if os.path.exists(path):
        return torch.load(path)
    hidden = _forward(model, window[None], parse_choice(REFERENCE_FORMAT), cfg, exact=True)[0][:window.numel() - 1]
    torch.save(hidden.clone(), path)
    return hidden


def run(args) -> None:
    from pagedkv.eval.compute import Compute
    from pagedkv.eval.config import EvalConfig
    from pagedkv.eval.metrics import hidden_window_sums
    from pagedkv.eval.runner import _forward, format_result, output_head, parse_choice
    from pagedkv.eval.tuned import resolve_tuned

    torch.set_num_threads(args.threads)
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    cfg = EvalConfig(formats=formats, windows=args.windows, window_tokens=args.window_tokens, decode_steps=0,
                     compute=Compute(args.threads, 1))
    skip = done_labels(args.out)
    todo = [f for f in formats if parse_choice(f).label not in skip]
    model, tokenizer, windows, label = load(args.model, args.window_tokens, args.windows)
    choices = resolve_tuned(model, tokenizer, [parse_choice(f) for f in todo], args.window_tokens,
                            directory=os.path.dirname(os.path.abspath(args.out)))
    head = output_head(model)
    for choice in choices:
        result = format_result(model, choice, cfg)
        cpu = time.process_time()
        for wi, w in enumerate(windows):
            ref = reference(model, w, cfg, f"{args.out}.ref{wi}.pt")
            hidden = _forward(model, w[None], choice, cfg)[0][:w.numel() - 1]
            pos = torch.arange(w.numel() - 1)
            result.sums.add_window(hidden_window_sums(head, [hidden], w[1:], ref, pos, w.numel())[0])
        row = {**result.as_dict(), "model": label, "windows": len(windows), "window_tokens": args.window_tokens,
               "seconds": round(time.process_time() - cpu, 1)}
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['format']}: {row['bits_per_element']:.3f} bits, KL {row['kl']:.4f}, "
              f"{row['seconds']:.0f} s", flush=True)


def show(path: str) -> None:
    """A markdown table of --out: format, bits, PPL, KL, then KL by position bucket (mean, and
    the lowest / highest window's mean with several windows)."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    buckets = [b["positions"] for b in rows[0]["kl_by_position"]]
    print("| format | bits/elem at the window's end | PPL | KL | " + " | ".join(f"KL {b}" for b in buckets) + " |")
    print("|---" * (4 + len(buckets)) + "|")
    for r in rows:
        cells = []
        for b in r["kl_by_position"]:
            per = b["kl_per_window"]
            cells.append(f"{b['kl']:.4f}" + (f" ({min(per):.4f}-{max(per):.4f})" if len(per) > 1 else ""))
        print(f"| {r['format']} | {r['bits_per_element']:.3f} | {r['ppl']:.3f} | {r['kl']:.4f} | "
              + " | ".join(cells) + " |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--formats", default="bf16,turbo3")
    p.add_argument("--window-tokens", type=int, default=8192)
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, help="results, one JSON row per format (appended)")
    p.add_argument("--show", action="store_true", help="print the table of --out and exit")
    args = p.parse_args(argv)
    if args.show:
        show(args.out)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
