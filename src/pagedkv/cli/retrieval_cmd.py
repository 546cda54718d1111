"""`pagedkv eval --task passkey|multikey`: retrieval accuracy of KV formats at long contexts
(`pagedkv.eval.retrieval`), the code path of `eval_cmd` for a retrieval task.

Every argument is checked before the model loads (tasks, lengths against the model's context read
from its config, depths, formats, the --plot file); the expected time is printed before the run;
the table (or JSON) is printed before the plot is drawn."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

from ..approx import Approximation
from ..eval.config import expand_formats
from ..eval.retrieval_config import (DEFAULT_PRESET, QUICK_PRESET, RetrievalConfig, parse_depths, parse_lengths,
                                     parse_tasks)
from .edge import check_output_file, compute_from_args, formats_for_model, read_text_arg
from .output import print_json, print_table, print_then_plot
from .sizes import parse_names


def config_from_args(args) -> RetrievalConfig:
    """The RetrievalConfig of the command line (ConfigError on one line for a bad argument)."""
    tasks = parse_tasks(args.task)
    preset = QUICK_PRESET if args.quick else DEFAULT_PRESET
    formats = expand_formats(parse_names(args.formats)) if args.formats else preset.formats
    lengths = parse_lengths(args.lengths) if args.lengths else preset.lengths
    trials = args.trials if args.trials is not None else preset.trials
    depths = parse_depths(args.depths) if args.depths else None
    units = len(tasks) * len(lengths) * (len(formats) + 1)
    return RetrievalConfig(tasks=tasks, formats=formats, lengths=lengths, trials=trials, depths=depths,
                           keys=args.keys, cue=args.cue, seed=args.seed, model=args.model,
                           compute=compute_from_args(args, parallel_work=units),
                           approx=Approximation.parse(args.approx))


def run(args, log, minutes, cpu_seconds) -> int:
    t0, cpu0 = time.perf_counter(), cpu_seconds()
    cfg = config_from_args(args)
    check_output_file(args.plot, "--plot", ".png")
    if args.plot:
        from ..eval.plot import require_matplotlib

        require_matplotlib()
    from ..eval.runner import check_unique, parse_choice

    choices = [parse_choice(f) for f in cfg.all_formats]
    check_unique(choices)
    text = read_text_arg(args.text) if "multikey" in cfg.tasks else None
    from ..eval.model import load_config, load_model, load_tokenizer, resolve_device, resolve_model_source

    source = resolve_model_source(cfg.model)
    gpu = resolve_device(args.device).type == "cuda"
    from ..integrations.model_config import trained_context

    model_config = load_config(source)
    cfg.check_context(trained_context(model_config), source.label)
    if args.formats:  # a plan's context against the model's
        cfg = replace(cfg, formats=formats_for_model(parse_names(args.formats), source, log, model_config))
        choices = [parse_choice(f) for f in cfg.all_formats]
    if cfg.compute.workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are forked after tokenizing
    cfg.compute.apply()
    from ..eval import retrieval as rt
    from ..eval.retrieval_tasks import TextCodec, generate, is_correct
    from ..eval.text import bos_id, tokenize

    tokenizer = load_tokenizer(source)
    codec = TextCodec(tokenizer)
    text_ids: list = []

    def text_tokens():
        if not text_ids:
            text_ids.extend(tokenize(tokenizer, text).tolist())
        return text_ids

    cells = {(task, n): generate(task, n, cfg.trials, codec, bos=bos_id(tokenizer), seed=cfg.seed,
                                 depths=cfg.depths, keys=cfg.keys, cue=cfg.cue, text_tokens=text_tokens)
             for task in cfg.tasks for n in cfg.lengths}
    units = rt.make_units(cells, choices)
    costing = rt.cost_model(model_config)
    seconds, computed, total = rt.estimate(units, cfg.block_size, costing, cfg.compute.workers)
    log(f"{source.label}: {', '.join(cfg.tasks)} at {', '.join(map(str, cfg.lengths))} tokens, {cfg.trials} trials "
        f"each, {len(choices)} formats ({len(units)} runs); prefix caching computes {computed} of {total} prompt "
        f"tokens; " + ("not estimated on a GPU (the estimate is fitted to CPU prefills)" if gpu else
                       f"expected ~{minutes(seconds)} on {cfg.compute.describe()} when those CPUs are idle"))
    log(f"loading {source.label} ...")
    lm = load_model(source, attn_implementation="pagedkv", device=args.device, tokenizer=tokenizer)
    from ..eval.tuned import resolve_tuned
    from ..integrations.transformers import enable

    enable(lm.model)
    resolved = resolve_tuned(lm.model, tokenizer, choices, max(cfg.lengths))
    if resolved != choices:
        units = rt.make_units(cells, resolved)
    costs = [rt.unit_seconds(u, cfg.block_size, costing) for u in units]
    t_run, cpu_run = time.perf_counter(), cpu_seconds()
    def done(unit, result) -> str:
        right = sum(is_correct(codec.decode(g), t.answer) for t, g in zip(unit.trials, result["generated"]))
        return (f"done: {unit.label}: {right}/{len(unit.trials)} right, {result['bits_per_element']:.3f} bits/elem, "
                f"{result['computed']} prompt tokens computed, {result['cpu_seconds']:.0f} s CPU")

    results = dict(_with_progress(lm.model, units, cfg, costs, done))
    elapsed = time.perf_counter() - t_run
    rows, records = rt.score(units, results, codec.decode)
    def show() -> None:
        if args.json:
            print_json({"model": source.label, "tasks": list(cfg.tasks), "lengths": list(cfg.lengths),
                        "trials": cfg.trials, "seed": cfg.seed, "keys": cfg.keys, "cue": cfg.cue, "rows": rows,
                        "trials_detail": records})
        else:
            _print(rows, source.label, cfg)

    from ..eval.retrieval_plot import plot_retrieval

    title = f"{source.label}: retrieval, {cfg.trials} paired trials per cell"
    print_then_plot(show, args.plot, lambda path: plot_retrieval(rows, path, title=title), log)
    wall, estimated = minutes(time.perf_counter() - t0), "not estimated on a GPU" if gpu else minutes(seconds)
    log("pagedkv eval --task {}: {} runs in {} wall (the runs {}, estimated {}); CPU {:.0f} s before the runs + "
        "{:.0f} s in them; {}".format(",".join(cfg.tasks), len(units), wall, minutes(elapsed), estimated,
                                      cpu_run - cpu0, cpu_seconds() - cpu_run, cfg.compute.describe()))
    return 0


def _with_progress(model, units, cfg, costs, done):
    """run_units with a progress bar; done(unit, result) -> a line printed as each unit finishes
    (so that an interrupted run still leaves the finished cells' numbers on stderr)."""
    from ..eval.retrieval import run_units

    total = sum(len(u.trials) for u in units)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        for i, result in run_units(model, units, cfg.block_size, costs, cfg.compute.workers, cfg.compute.threads):
            print(done(units[i], result), file=sys.stderr, flush=True)
            yield i, result
        return
    with tqdm(total=total, desc="trials", unit="trial", file=sys.stderr) as bar:
        def step(label):
            bar.set_postfix_str(label)
            bar.update(1)
        for i, result in run_units(model, units, cfg.block_size, costs, cfg.compute.workers, cfg.compute.threads,
                                   step):
            bar.write(done(units[i], result), file=sys.stderr)
            yield i, result


def _print(rows, label: str, cfg: RetrievalConfig) -> None:
    cols = ["task", "length", "format", "bits/elem", "accuracy", "95% CI", "bf16", "lost", "gained",
            "McNemar p", "note"]
    table = [[r["task"], r["length"], r["format"], r["bits_per_element"], f"{r['correct']}/{r['trials']}",
              f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}", f"{r['bf16_accuracy']:.2f}", r["lost"], r["gained"],
              f"{r['mcnemar_p']:.3g}", "" if r["informative"] else "not informative (bf16 < 80%)"]
             for r in rows]
    multikey = (f"; multikey: {cfg.keys} needles per context, each queried once (those trials are correlated), "
                f"asked by the {cfg.cue} cue"
                if "multikey" in cfg.tasks else "")
    print_table(f"{label}: retrieval, {cfg.trials} paired trials per task and length (seed {cfg.seed}), greedy "
                f"exact match; bits/elem as stored at that length; lost / gained: trials bf16 got right and the "
                f"format wrong / the reverse, McNemar's exact test{multikey}", cols, table)
