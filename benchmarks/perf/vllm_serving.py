"""vLLM serving throughput: vLLM's own KV formats against pagedkv's, same prompts, one run.

    .venv-vllm/bin/python benchmarks/perf/vllm_serving.py [--budgets 64MiB,1GiB] [--json]

Configurations: vLLM bf16 (its CPU backend, model in bf16), vLLM auto (its CPU backend, KV in the
model's --dtype, e.g. float32), vLLM fp8 (kv_cache_dtype=fp8; needs AVX-512 on CPU, reported as
unsupported otherwise), and pagedkv fp8 / turbo4 / turbo3 /
fp8k_turbo3v pages (each name as everywhere in pagedkv: that format in every layer, no
high-precision layers; statistics fitted at engine start). Every configuration serves the same prompts (distinct windows of
`pydoc_data.topics`, `--prompt-tokens` each, prefix caching off) with greedy decoding of
`--max-tokens` tokens, submitted at once, under each KV budget (`kv_cache_memory_bytes`): a
small one where bf16 is KV-bound and a large one where nothing is.

Per configuration and budget: KV capacity in tokens (what vLLM reports), the most requests
vLLM ran at once (overlap of scheduled..last-token intervals), output tokens/s over the whole
run, mean time to first token, total time, each also as a ratio to vLLM's own cache (the first
vllm-bf16 / vllm-auto row) under the same budget; and the engine process's CPU time over the run
(the engine runs in the child's process, one torch thread by default) with output tokens per CPU
second: on a shared machine wall-clock rows taken minutes apart see different loads (the load
column), CPU time much less so. `--threads` threads per engine (default 1: on
a shared 2-core machine loaded past its cores, OpenMP's spinning threads cost more than a
second thread gives; `benchmarks/perf/vllm_attention_step.py` measures it). Each engine runs in a fresh child process (one vLLM engine per process), one after the
other, so every row sees the same machine state; the table prints at the end (`--json` prints
the rows as JSON instead).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, ".venv-vllm", "smollm2-hf")
CONFIGS = ("vllm-bf16", "vllm-auto", "vllm-fp8", "pagedkv-fp8", "pagedkv-turbo4", "pagedkv-turbo3",
           "pagedkv-fp8k_turbo3v")
UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    for unit, mult in UNITS.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mult)
    return int(t)


def engine_kwargs(config: str, budget: int, args) -> dict:
    kw = dict(model=args.model, dtype=args.dtype, enforce_eager=True, kv_cache_memory_bytes=budget,
              max_model_len=args.prompt_tokens + args.max_tokens + 16, enable_prefix_caching=False,
              disable_log_stats=False, distributed_executor_backend="uni", seed=0,
              max_num_seqs=args.prompts)
    kind, fmt = config.split("-", 1)
    if kind == "vllm":
        if fmt not in ("bf16", "auto"):
            kw["kv_cache_dtype"] = fmt
    else:
        kw["additional_config"] = {"pagedkv": {"kv_format": fmt}}
    return kw


def prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct token windows of `length` (BOS first) spread over pydoc_data.topics."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from pagedkv.eval.text import bos_id, default_text, make_windows, tokenize

    return [w.tolist() for w in make_windows(tokenize(tokenizer, default_text()), n, length, bos_id(tokenizer))]


def run_one(config: str, budget: int, args) -> dict:
    """One engine, one run (in this process). Returns the row's raw numbers."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(config, budget, args))
    start_s = time.perf_counter() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    ids = prompts(llm.get_tokenizer(), args.prompts, args.prompt_tokens)
    sp = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, temperature=0.0,
                        ignore_eos=True)
    t1, c1 = time.perf_counter(), time.process_time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sp, use_tqdm=False)
    total, cpu = time.perf_counter() - t1, time.process_time() - c1
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    spans = [(o.metrics.scheduled_ts, o.metrics.last_token_ts) for o in outs if o.metrics is not None]
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    ttft = [o.metrics.first_token_latency for o in outs if o.metrics is not None]
    return {"config": config, "budget_bytes": budget, "capacity_tokens": int(cc.num_gpu_blocks) * int(cc.block_size),
            "concurrency": peak, "output_tokens": out_tokens, "output_tok_s": out_tokens / total,
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None, "total_s": total,
            "cpu_s": cpu, "output_tok_per_cpu_s": out_tokens / cpu,
            "engine_start_s": start_s, "torch_threads": torch.get_num_threads(),
            "load_1min": os.getloadavg()[0], "sample": outs[0].outputs[0].text[:60]}


def child(config: str, budget: int, args) -> dict:
    """Run one configuration in a fresh process; a failed start becomes a row with its error."""
    cmd = [sys.executable, os.path.abspath(__file__), "--one", config, "--budget", str(budget),
           "--model", args.model, "--dtype", args.dtype, "--prompts", str(args.prompts),
           "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
           "--threads", str(args.threads)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    # the in-process engine ("uni" executor) does not apply the bind's thread count to torch's
    # OpenMP pool, which starts with the child: set it there (rows report torch_threads)
    env["OMP_NUM_THREADS"] = str(args.threads)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    err = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln]
    return {"config": config, "budget_bytes": budget, "error": (err[-1] if err else f"exit {p.returncode}")[-160:]}


def with_ratios(rows: list[dict]) -> list[dict]:
    base = {}
    for r in rows:  # the first vLLM bf16 / auto row of each budget
        if r["config"] in ("vllm-bf16", "vllm-auto") and "error" not in r:
            base.setdefault(r["budget_bytes"], r)
    for r in rows:
        b = base.get(r["budget_bytes"])
        if b is None or "error" in r:
            continue
        r["ratio"] = {k: (r[k] / b[k] if b[k] else None)
                      for k in ("capacity_tokens", "concurrency", "output_tok_s", "mean_ttft_s", "total_s", "cpu_s",
                          "output_tok_per_cpu_s")
                      if r.get(k) is not None and b.get(k) is not None}
    return rows


def value_ratio(value, ratio, fmt: str = "{:.1f}") -> str:
    """Two table cells, `value | ratio`: the value in `fmt` and its ratio to the baseline row as
    `1.23x`, each blank when missing (both serving benchmarks' tables)."""
    return ("" if value is None else fmt.format(value)) + " | " + ("" if ratio is None else f"{ratio:.2f}x")


def table(rows: list[dict], args) -> str:
    loads = [r["load_1min"] for r in rows if "load_1min" in r] or [os.getloadavg()[0]]
    threads = ",".join(str(t) for t in sorted({r["torch_threads"] for r in rows if "torch_threads" in r})) or "?"
    head = (f"{args.prompts} prompts x {args.prompt_tokens} tokens + {args.max_tokens} new (greedy), "
            f"model dtype {args.dtype}, eager, torch threads in the engines {threads}, load "
            f"{min(loads):.1f}-{max(loads):.1f}; ratios to vLLM's own cache ({args.dtype} KV) at the same KV budget")
    cols = ("KV budget", "config", "KV tokens", "x", "concurrency", "x", "out tok/s", "x",
            "mean TTFT s", "x", "total s", "x", "CPU s", "x", "out tok / CPU s", "x", "load")
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        mib = f"{r['budget_bytes'] / (1 << 20):g} MiB"
        if "error" in r:
            lines.append(f"| {mib} | {r['config']} | not supported here: {r['error']} |")
            continue
        q = r.get("ratio", {})

        def cell(k, fmt="{:.1f}"):
            return value_ratio(r.get(k), q.get(k), fmt)

        load = "" if r.get("load_1min") is None else f"{r['load_1min']:.1f}"
        lines.append(f"| {mib} | {r['config']} | {cell('capacity_tokens', '{:,}')} | {cell('concurrency', '{}')} | "
                     f"{cell('output_tok_s')} | {cell('mean_ttft_s')} | {cell('total_s')} | {cell('cpu_s')} | "
                     f"{cell('output_tok_per_cpu_s', '{:.2f}')} | {load} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--budgets", default="64MiB,1GiB", help="KV budgets (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1,
                   help="threads per engine (VLLM_CPU_OMP_THREADS_BIND=0..N-1; default %(default)s: on a "
                        "shared machine loaded past its cores, spinning OpenMP threads cost more than they give)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.add_argument("--save", default=None, metavar="FILE", help="also write the rows as JSON to FILE")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args.budget, args)), flush=True)
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS and not c.startswith("pagedkv-"):
            p.error(f"--configs: unknown {c!r}; accepted: {', '.join(CONFIGS)} or pagedkv-<format>")
    if "vllm-bf16" in configs and args.dtype not in ("bfloat16", "bf16"):
        p.error(f"vllm-bf16 needs --dtype bfloat16 (vLLM's CPU backend keeps its KV in the model dtype); "
                f"with --dtype {args.dtype} name vllm-auto")
    rows, failed = [], {}
    for budget in (parse_bytes(b) for b in args.budgets.split(",")):
        for c in configs:
            if c in failed:  # a start that failed once (e.g. no AVX-512 for vLLM fp8) fails again
                rows.append(dict(failed[c], budget_bytes=budget))
                continue
            rows.append(child(c, budget, args))
            if "error" in rows[-1]:
                failed[c] = rows[-1]
            print(f"done {c} @ {budget >> 20} MiB: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    rows = with_ratios(rows)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    print(json.dumps(rows, indent=2) if args.json else table(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
