"""Long-context decode speed end to end: pagedkv formats against the same engine's own cache.

    python benchmarks/perf/long_context_decode.py [--contexts 8k,16k] [--batches 1,8] [--steps 8]
        [--formats turbo3,fp8k_turbo3v] [--front-doors vllm,transformers] [--json] [--save FILE]

A format may name the approximate attention paths after an @ (`turbo3@int8_scores`: the
drop-in's `approx=`, vLLM's `"approx"` setting; `pagedkv.approx`).

Two front doors, each against its own cache, the embedded SmolLM2 in float32 (bf16 matmuls on an
AVX2 CPU cost 4-7x fp32, see docs/performance.md), greedy decoding:
- vllm: a vLLM engine (CPU, eager) with its own cache (`vllm-auto`: the model dtype, fp32) or
  pagedkv pages (`--additional-config {"pagedkv": {"kv_format": F}}`);
- transformers: the model with transformers' own `DynamicCache` (fp32, SDPA) or pagedkv's
  drop-in `PagedKVCache(model, F)`.
Per context C (8k, 16k) and batch B (1, 8): decode tokens/s = B / the median step time of
--steps decode steps (after one step not timed) with C tokens of context per sequence, and the
ratio to the front door's own cache at the same C and B; the same per CPU second (the child's
process CPU time per step: transformers per step, vLLM as the CPU time of B rows generating
steps + 1 tokens less that of B rows generating 1), which a shared machine's load moves much
less than wall-clock time.

SmolLM2-135M was trained to 8k positions (max_position_embeddings 8192): the 16k rows run past
it (vLLM: `hf_overrides` raises the limit; transformers computes RoPE for any position), which
changes what the model says, not the work per step that is timed here.

Prefilling 8 sequences of 16k tokens costs ~8x one sequence (minutes each here), so every batch
shares one prompt: vLLM serves B prompts that are the same block-aligned prefix (prefilled once,
then a prefix-cache hit) plus distinct 64-token tails; the transformers caches prefill one row
and repeat it (`batch_repeat_interleave`: copies in DynamicCache, shared blocks in pagedkv, as
for beams). The 8k prompt is the first half of the 16k one, so each engine prefills ~16k tokens
once. Every (front door, cache) runs in a fresh child process, one after the other (vLLM in
vLLM's environment, transformers in pagedkv's: vLLM pins transformers < 5.20), with
--threads torch threads; rows give the 1-minute load average when they finished (the machine is
shared: quote it with the ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, ".venv-vllm", "smollm2-hf")
TAIL = 64  # distinct tokens per vLLM prompt after the shared prefix


def parse_tokens(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def token_stream(tokenizer, n: int) -> list[int]:
    """The first n tokens of pagedkv's default evaluation text (BOS first when there is one)."""
    sys.path.insert(0, os.path.join(ROOT, "src"))
    from pagedkv.eval.text import bos_id, default_text, tokenize

    ids = tokenize(tokenizer, default_text()).tolist()
    bos = bos_id(tokenizer)
    ids = ([bos] if bos is not None else []) + ids
    if len(ids) < n:
        raise SystemExit(f"the default text has {len(ids)} tokens, {n} needed")
    return ids[:n]


# -- vLLM -----------------------------------------------------------------------------------
def run_vllm(config: str, args) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    contexts = [parse_tokens(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    max_len = max(contexts) + args.steps + 16
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        trained = int(json.load(f).get("max_position_embeddings") or max_len)
    kw = dict(model=args.model, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=args.kv_bytes,
              max_model_len=max_len, enable_prefix_caching=True, distributed_executor_backend="uni", seed=0,
              max_num_seqs=max(batches), disable_log_stats=False,
              # SmolLM2-135M was trained to 8k: longer rows time the same work past its positions
              # (vLLM sizes its RoPE table and max_model_len check from this)
              hf_overrides={"max_position_embeddings": max(trained, max_len)})
    if config != "vllm-auto":
        fmt, _, approx = config.split("-", 1)[1].partition("@")
        kw["additional_config"] = {"pagedkv": {"kv_format": fmt, **({"approx": approx} if approx else {})}}
    llm = LLM(**kw)
    bs = int(llm.llm_engine.vllm_config.cache_config.block_size)
    stream = token_stream(llm.get_tokenizer(), max(contexts) + TAIL * max(batches))
    far = max(contexts)  # tails come from beyond every prefix
    rows = []
    for ctx in contexts:
        prefix = stream[:(ctx - TAIL) // bs * bs]
        prompts = [prefix + stream[far + i * TAIL: far + (i + 1) * TAIL] for i in range(max(batches))]
        t = time.perf_counter()  # the prefix (what earlier contexts did not cache) and its KV
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], SamplingParams(max_tokens=1), use_tqdm=False)
        prefill_s = time.perf_counter() - t
        def run(b: int, n: int):
            sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
            c = time.process_time()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:b]], sp, use_tqdm=False)
            return outs, time.process_time() - c

        for b in batches:
            _, cpu_first = run(b, 1)  # the tails' prefill and one token: subtracted below
            outs, cpu_all = run(b, args.steps + 1)
            # the engine decodes the B rows in lockstep: each row's first..last token span is
            # `steps` steps (its prefix came from the cache, its tail was prefilled before)
            spans = [(o.metrics.last_token_ts - o.metrics.first_token_ts) / args.steps for o in outs]
            rows.append(_row("vllm", config, len(prompts[0]), b, statistics.median(spans),
                             (cpu_all - cpu_first) / args.steps, prefill_s,
                             cached=min(o.num_cached_tokens for o in outs)))
    return rows


# -- transformers ---------------------------------------------------------------------------
def run_transformers(config: str, args) -> list[dict]:
    import torch

    sys.path.insert(0, os.path.join(ROOT, "src"))
    from pagedkv.eval.model import load_model, resolve_model_source

    torch.set_num_threads(args.threads)
    contexts = [parse_tokens(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    own = config == "hf-dynamic"
    lm = load_model(resolve_model_source(args.model), attn_implementation="sdpa" if own else "pagedkv")
    model = lm.model
    if own:
        from transformers import DynamicCache

        cache = DynamicCache()
    else:
        from pagedkv.integrations.transformers import PagedKVCache

        fmt, _, approx = config[len("hf-pagedkv-"):].partition("@")
        cache = PagedKVCache(model, fmt, checks=False, approx=approx or None)
    stream = torch.tensor([token_stream(lm.tokenizer, max(contexts))])
    rows = []
    with torch.inference_mode():
        for ctx in contexts:
            target = ctx - TAIL  # the context vLLM's rows start decoding from
            t = time.perf_counter()
            for a in range(cache.get_seq_length(), target, args.chunk):
                out = model(stream[:, a:min(a + args.chunk, target)], past_key_values=cache, use_cache=True)
            prefill_s = time.perf_counter() - t
            nxt = out.logits[:, -1:].argmax(-1)
            for b in batches:
                if b > 1:
                    cache.batch_repeat_interleave(b)
                    nxt = nxt.repeat_interleave(b, dim=0)
                times, cpus = [], []
                for _ in range(args.steps + 1):
                    t, c = time.perf_counter(), time.process_time()
                    out = model(nxt, past_key_values=cache, use_cache=True)
                    nxt = out.logits[:, -1:].argmax(-1)
                    times.append(time.perf_counter() - t)
                    cpus.append(time.process_time() - c)
                rows.append(_row("transformers", config, target, b, statistics.median(times[1:]),
                                 statistics.median(cpus[1:]), prefill_s))
                if b > 1:  # back to the one row; the next context continues it
                    cache.batch_select_indices(torch.tensor([0]))
                    nxt = nxt[:1]
    return rows


def _row(front: str, config: str, context: int, batch: int, step_s: float, step_cpu_s: float,
         prefill_s: float, **extra) -> dict:
    import torch

    return {"front_door": front, "config": config, "context": context, "batch": batch,
            "step_ms": 1e3 * step_s, "decode_tok_s": batch / step_s, "step_cpu_ms": 1e3 * step_cpu_s,
            "decode_tok_per_cpu_s": batch / step_cpu_s, "prefill_s": prefill_s,
            "torch_threads": torch.get_num_threads(), "load_1min": os.getloadavg()[0], **extra}


# -- the parent: one child per (front door, cache), then the table ----------------------------
def configs_of(front: str, formats: list[str]) -> list[str]:
    own = "vllm-auto" if front == "vllm" else "hf-dynamic"
    prefix = "pagedkv-" if front == "vllm" else "hf-pagedkv-"
    return [own] + [prefix + f for f in formats]


def child(front: str, config: str, args) -> list[dict]:
    python = args.vllm_python if front == "vllm" else args.hf_python
    cmd = [python, os.path.abspath(__file__), "--one", front, config, "--model", args.model,
           "--contexts", args.contexts, "--batches", args.batches, "--steps", str(args.steps),
           "--threads", str(args.threads), "--chunk", str(args.chunk), "--kv-bytes", str(args.kv_bytes)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=str(args.threads), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_OMP_THREADS_BIND="0" if args.threads == 1 else f"0-{args.threads - 1}")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("["):
            return json.loads(line)
    err = [ln for ln in p.stderr.splitlines() if "Error" in ln or "error" in ln]
    return [{"front_door": front, "config": config, "error": (err[-1] if err else f"exit {p.returncode}")[-200:]}]


def with_ratios(rows: list[dict]) -> list[dict]:
    base = {(r["front_door"], r["context"], r["batch"]): r for r in rows
            if r["config"] in ("vllm-auto", "hf-dynamic") and "error" not in r}
    for r in rows:
        b = base.get((r.get("front_door"), r.get("context"), r.get("batch")))
        if b is not None and "error" not in r:
            r["ratio"] = r["decode_tok_s"] / b["decode_tok_s"]
            if r.get("decode_tok_per_cpu_s") and b.get("decode_tok_per_cpu_s"):
                r["cpu_ratio"] = r["decode_tok_per_cpu_s"] / b["decode_tok_per_cpu_s"]
    return rows


def _num(r: dict, key: str, fmt: str) -> str:
    return "" if r.get(key) is None else fmt.format(r[key])


def table(rows: list[dict]) -> str:
    lines = ["| front door | cache | context | batch | decode tok/s | x own cache | step ms | "
             "tok / CPU s | x own cache | step CPU ms | prefill s | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['front_door']} | {r['config']} | failed: {r['error']} |")
            continue
        lines.append(f"| {r['front_door']} | {r['config']} | {r['context']:,} | {r['batch']} | "
                     f"{r['decode_tok_s']:.2f} | {r.get('ratio', float('nan')):.2f}x | {r['step_ms']:.0f} | "
                     f"{_num(r, 'decode_tok_per_cpu_s', '{:.2f}')} | {_num(r, 'cpu_ratio', '{:.2f}x')} | "
                     f"{_num(r, 'step_cpu_ms', '{:.0f}')} | {r['prefill_s']:.0f} | {r['load_1min']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="an HF model folder (default: %(default)s)")
    p.add_argument("--contexts", default="8k,16k")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per row (default %(default)s)")
    p.add_argument("--formats", default="turbo3,fp8k_turbo3v")
    p.add_argument("--front-doors", default="vllm,transformers")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--chunk", type=int, default=2048, help="transformers prefill chunk (default %(default)s)")
    p.add_argument("--kv-bytes", type=int, default=3 << 29, help="vLLM KV budget (default 1.5 GiB)")
    p.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    p.add_argument("--hf-python", default=os.environ.get("PAGEDKV_MAIN_PYTHON",
                                                         os.path.join(ROOT, ".venv", "bin", "python")))
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.add_argument("--save", default=None, metavar="FILE", help="also write the rows as JSON to FILE")
    p.add_argument("--one", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.threads < 1 or args.chunk < 1:
        p.error("--steps, --threads and --chunk must be >= 1")
    if args.one:
        front, config = args.one
        rows = run_vllm(config, args) if front == "vllm" else run_transformers(config, args)
        print(json.dumps(rows), flush=True)
        return 0
    fronts = [f.strip() for f in args.front_doors.split(",") if f.strip()]
    bad = [f for f in fronts if f not in ("vllm", "transformers")]
    if bad:
        p.error(f"--front-doors: unknown {bad[0]!r}; accepted: vllm, transformers")
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    rows = []
    for front in fronts:
        for config in configs_of(front, formats):
            got = child(front, config, args)
            rows += got
            print(f"done {front} {config}: {json.dumps(got)}", file=sys.stderr, flush=True)
    rows = with_ratios(rows)
    if args.save:
        with open(args.save, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
