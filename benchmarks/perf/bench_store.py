"""Cache write (store) on CPU: the reference encoder vs the C store of the "cpu" backend.

Per codec, one process, one thread:
- speed: M elements/s (K and V elements written per second) of `pagedkv.ops.reference.store`
  and `pagedkv.ops.cpu.store` on the same chunk, calls interleaved (ref, C, ref, C, ...),
  medians of --repeats, timed as the thread's CPU time (the machine may be shared);
- memory: a fresh child process per (store, codec) allocates the pools of --layers layers, warms
  up with one call, then makes --calls store calls interleaved over the layers (chunk c goes to
  every layer in turn, fresh slots each time, as a chunked prefill does) and reports the growth
  of the resident set (VmRSS) and glibc's free-but-held heap (mallinfo2 fordblks) over them.
- decode-shaped calls: microseconds per store call of one token (K and V), as each layer of a
  decode step makes;
- with --model-prefill: end to end on the embedded SmolLM2 (30 layers, 3 KV heads, head_dim 64),
  a --prompt-tokens prefill in chunks of --tokens and --decode-steps greedy steps, with the
  "cpu" backend's store set to the reference store or the C store (attention is the C kernel in
  both), seconds and tokens/s side by side.
- with --model-memory: one fresh process per (format, store) runs the embedded model over a
  --memory-tokens prefill (chunks of --tokens) and --decode-steps decode steps, then reports the
  resident set, the resident set less the cache pools, glibc's free-but-held heap, and the
  resident set less the pools after malloc_trim(0) (what the allocator could give back).
The default shape is one SmolLM2 prefill chunk: 256 tokens x 3 KV heads x head_dim 64.

    .venv/bin/python benchmarks/perf/bench_store.py [--codecs turbo3,q8_0] [--no-memory]
        [--model-prefill] [--model-memory]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _ref_store():
    return importlib.import_module("pagedkv.ops.reference.store").store


def _cpu_store():
    import pagedkv.ops.cpu as cpu

    if not cpu.available():
        raise SystemExit(f"the CPU kernel is unavailable: {cpu.kernel_info()}")
    return cpu.store


def _layer(codec_name: str, tokens: int, heads: int, head_dim: int, block_size: int = 16):
    from pagedkv.codecs.catalogue import CODECS
    from pagedkv.ops import make_layer

    codec = CODECS[codec_name]
    return make_layer(codec, codec, -(-tokens // block_size), block_size, heads, head_dim)


def speed(codec_name: str, tokens: int, heads: int, head_dim: int, repeats: int) -> dict:
    """Median M elements/s of both stores on one chunk (K and V), calls interleaved."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(tokens, heads, head_dim, generator=gen)
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    layer = _layer(codec_name, tokens, heads, head_dim)
    slots = torch.randperm(tokens, generator=gen).long()
    impls = {"reference": _ref_store(), "cpu": _cpu_store()}
    times = {name: [] for name in impls}
    for fn in impls.values():
        fn(layer, k, v, slots)  # warm-up (compiles, caches tables)
    for _ in range(repeats):
        for name, fn in impls.items():
            t = time.thread_time()  # this thread's CPU time: robust on a shared machine
            fn(layer, k, v, slots)
            times[name].append(time.thread_time() - t)
    elements = 2 * k.numel()
    return {name: elements / statistics.median(ts) / 1e6 for name, ts in times.items()}


def per_call_us(codec_name: str, heads: int, head_dim: int, repeats: int = 200) -> dict:
    """Median microseconds (thread CPU time) of a one-token store call (K and V) of both stores."""
    layer = _layer(codec_name, 64, heads, head_dim)
    x = torch.randn(1, heads, head_dim, generator=torch.Generator().manual_seed(2))
    slot = torch.tensor([17], dtype=torch.int64)
    out = {}
    for name, fn in (("reference", _ref_store()), ("cpu", _cpu_store())):
        for _ in range(5):
            fn(layer, x, x, slot)
        ts = []
        for _ in range(repeats):
            t = time.thread_time_ns()
            fn(layer, x, x, slot)
            ts.append(time.thread_time_ns() - t)
        out[name] = statistics.median(ts) / 1e3
    return out


def model_prefill(formats: list[str], prompt_tokens: int, chunk: int, decode_steps: int,
                  repeats: int = 2) -> list[dict]:
    """Embedded SmolLM2: chunked prefill + greedy decode with the reference vs the C store.

    The runs alternate (ref, C, ref, C, ...) and the fastest of `repeats` is kept (the machine is
    shared); the time spent inside the store calls is measured too (a timing wrapper)."""
    import dataclasses

    import pagedkv.ops.cpu as cpu
    from pagedkv.eval.model import load_model, resolve_model_source
    from pagedkv.eval.runner import cache_for, parse_choice
    from pagedkv.ops.dispatch import register_backend

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    lm = load_model(resolve_model_source(None), attn_implementation="pagedkv", device="cpu")
    model = lm.model
    ids = torch.randint(100, model.config.vocab_size - 100, (1, prompt_tokens),
                        generator=torch.Generator().manual_seed(3))
    spent = [0.0]

    def timed(fn):
        def wrapper(*args):
            t = time.perf_counter()
            fn(*args)
            spent[0] += time.perf_counter() - t
        return wrapper

    stores = {"reference": _ref_store(), "cpu": cpu.store}
    rows = []
    try:
        for fmt in formats:
            best: dict = {}
            for _ in range(repeats):
                for name, fn in stores.items():
                    register_backend(dataclasses.replace(cpu.BACKEND, store=timed(fn)))
                    cache = cache_for(model, parse_choice(fmt))
                    with torch.inference_mode():
                        spent[0], t = 0.0, time.perf_counter()
                        for start in range(0, prompt_tokens, chunk):
                            out = model(ids[:, start:start + chunk], past_key_values=cache, use_cache=True)
                        prefill, prefill_store = time.perf_counter() - t, spent[0]
                        nxt = out.logits[:, -1:].argmax(-1)
                        spent[0], t = 0.0, time.perf_counter()
                        for _ in range(decode_steps):
                            out = model(nxt, past_key_values=cache, use_cache=True)
                            nxt = out.logits[:, -1:].argmax(-1)
                        decode, decode_store = time.perf_counter() - t, spent[0]
                    run = {"prefill_s": prefill, "prefill_store_s": prefill_store,
                           "decode_ms": 1e3 * decode / max(1, decode_steps),
                           "decode_store_ms": 1e3 * decode_store / max(1, decode_steps)}
                    if name not in best or run["prefill_s"] < best[name]["prefill_s"]:
                        best[name] = {**best.get(name, {}), **{k: v for k, v in run.items() if "prefill" in k}}
                    if "decode_ms" not in best[name] or run["decode_ms"] < best[name]["decode_ms"]:
                        best[name].update({k: v for k, v in run.items() if "decode" in k})
            rows.append({"format": fmt, **{f"{n}_{k}": v for n, r in best.items() for k, v in r.items()}})
    finally:
        register_backend(cpu.BACKEND)
    return rows


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _fordblks() -> int:
    """glibc's free bytes held in the heap (mallinfo2().fordblks); -1 without glibc >= 2.33."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return -1


def memory_child(impl: str, codec_name: str, tokens: int, heads: int, head_dim: int,
                 calls: int, layers: int) -> dict:
    """Run in a fresh process: RSS / fordblks growth over `calls` interleaved store calls."""
    torch.set_num_threads(1)
    fn = _ref_store() if impl == "reference" else _cpu_store()
    chunks = -(-calls // layers) + 1
    pools = [_layer(codec_name, tokens * chunks, heads, head_dim) for _ in range(layers)]
    for layer in pools:  # touch the pools so that their pages count before the baseline
        layer.k_pool.fill_(1)
        layer.v_pool.fill_(1)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(tokens, heads, head_dim, generator=gen)
    v = torch.randn(tokens, heads, head_dim, generator=gen)
    fn(pools[0], k, v, torch.arange(tokens, dtype=torch.int64))  # warm-up
    rss0, free0 = _rss_bytes(), _fordblks()
    t = time.perf_counter()
    for c in range(calls):
        chunk, layer = 1 + c // layers, pools[c % layers]
        slots = torch.arange(chunk * tokens, (chunk + 1) * tokens, dtype=torch.int64)
        fn(layer, k, v, slots)
    seconds = time.perf_counter() - t
    return {"rss_growth": _rss_bytes() - rss0, "fordblks": _fordblks(), "fordblks_growth": _fordblks() - free0,
            "seconds": seconds}


def model_memory_child(fmt: str, impl: str, tokens: int, chunk: int, decode_steps: int) -> dict:
    """In a fresh process: memory after a chunked prefill + decode of the embedded model."""
    import dataclasses

    import pagedkv.ops.cpu as cpu
    from pagedkv.eval.model import load_model, resolve_model_source
    from pagedkv.eval.runner import cache_for, parse_choice
    from pagedkv.ops.dispatch import register_backend

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    if impl == "reference":
        register_backend(dataclasses.replace(cpu.BACKEND, store=_ref_store()))
    lm = load_model(resolve_model_source(None), attn_implementation="pagedkv", device="cpu")
    model = lm.model
    ids = torch.randint(100, model.config.vocab_size - 100, (1, tokens), generator=torch.Generator().manual_seed(3))
    cache = cache_for(model, parse_choice(fmt))
    rss0 = _rss_bytes()
    with torch.inference_mode():
        for start in range(0, tokens, chunk):
            out = model(ids[:, start:start + chunk], past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(decode_steps):
            out = model(nxt, past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
    del out
    pools = cache.pool_bytes()
    rss, free = _rss_bytes(), _fordblks()
    try:  # what glibc can hand back: free heap pages returned to the OS
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return {"rss_mb": rss / 2**20, "growth_mb": (rss - rss0) / 2**20, "pools_mb": pools / 2**20,
            "growth_less_pools_mb": (rss - rss0 - pools) / 2**20, "fordblks_mb": free / 2**20,
            "growth_less_pools_after_trim_mb": (_rss_bytes() - rss0 - pools) / 2**20}


def memory(impl: str, codec_name: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, "--codecs", codec_name, "--tokens", str(args.tokens),
           "--heads", str(args.heads), "--head-dim", str(args.head_dim), "--calls", str(args.calls),
           "--layers", str(args.layers)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from pagedkv.codecs.catalogue import CODECS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec names")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--no-memory", action="store_true", help="skip the per-process memory runs")
    p.add_argument("--model-prefill", action="store_true", help="also run the embedded model end to end")
    p.add_argument("--model-formats", default="turbo3,q8_0,bf16")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--json", action="store_true")
    p.add_argument("--model-memory", action="store_true", help="memory of a model run per (format, store)")
    p.add_argument("--memory-tokens", type=int, default=4096)
    p.add_argument("--child", choices=("reference", "cpu"), help=argparse.SUPPRESS)
    p.add_argument("--child-model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = [n.strip() for n in args.codecs.split(",") if n.strip()]
    if args.child and args.child_model:
        print(json.dumps(model_memory_child(args.child_model, args.child, args.memory_tokens, args.tokens,
                                            args.decode_steps)))
        return 0
    if args.child:
        print(json.dumps(memory_child(args.child, names[0], args.tokens, args.heads, args.head_dim,
                                      args.calls, args.layers)))
        return 0

    rows = []
    for name in names:
        row = {"codec": name, **{f"{k}_meps": v for k, v in speed(name, args.tokens, args.heads,
                                                                   args.head_dim, args.repeats).items()}}
        row.update({f"{k}_call_us": v for k, v in per_call_us(name, args.heads, args.head_dim).items()})
        if not args.no_memory:
            for impl in ("reference", "cpu"):
                m = memory(impl, name, args)
                row[f"{impl}_rss_mb"] = m["rss_growth"] / 2**20
                row[f"{impl}_fordblks_mb"] = m["fordblks"] / 2**20
        rows.append(row)
        if not args.json:
            line = (f"| {name} | {row['reference_meps']:.1f} | {row['cpu_meps']:.1f} | "
                    f"{row['cpu_meps'] / row['reference_meps']:.1f} | {row['reference_call_us']:.0f} | "
                    f"{row['cpu_call_us']:.0f} |")
            if not args.no_memory:
                line += (f" {row['reference_rss_mb']:+.1f} | {row['cpu_rss_mb']:+.1f} | "
                         f"{row['reference_fordblks_mb']:.1f} | {row['cpu_fordblks_mb']:.1f} |")
            if len(rows) == 1:
                head = "| codec | reference M el/s | C M el/s | speedup | ref us/1-token call | C us/1-token call |"
                sep = "|---|---|---|---|---|---|"
                if not args.no_memory:
                    head += f" ref dRSS MB ({args.calls} calls) | C dRSS MB | ref heap free MB | C heap free MB |"
                    sep += "---|---|---|---|"
                print(f"shape: {args.tokens} tokens x {args.heads} kv heads x head_dim {args.head_dim}, "
                      f"K and V, 1 thread, medians of {args.repeats}")
                print(head)
                print(sep)
            print(line, flush=True)
    model_rows = []
    if args.model_prefill:
        model_rows = model_prefill([f.strip() for f in args.model_formats.split(",") if f.strip()],
                                   args.prompt_tokens, args.tokens, args.decode_steps)
        if not args.json:
            print(f"\nembedded SmolLM2, {args.prompt_tokens}-token prefill in chunks of {args.tokens}, "
                  f"{args.decode_steps} decode steps, {torch.get_num_threads()} thread(s)")
            print("| format | prefill s, ref store (in store) | prefill s, C store (in store) | ratio | "
                  "decode ms/token, ref store (in store) | decode ms/token, C store (in store) |")
            print("|---|---|---|---|---|---|")
            for r in model_rows:
                print(f"| {r['format']} | {r['reference_prefill_s']:.2f} ({r['reference_prefill_store_s']:.2f}) | "
                      f"{r['cpu_prefill_s']:.2f} ({r['cpu_prefill_store_s']:.2f}) | "
                      f"{r['cpu_prefill_s'] / r['reference_prefill_s']:.2f} | "
                      f"{r['reference_decode_ms']:.1f} ({r['reference_decode_store_ms']:.1f}) | "
                      f"{r['cpu_decode_ms']:.1f} ({r['cpu_decode_store_ms']:.1f}) |")
    mem_rows = []
    if args.model_memory:
        runs = [("bf16", "cpu")] + [(f, impl) for f in args.model_formats.split(",") if f.strip() != "bf16"
                                     for impl in ("reference", "cpu")]
        for fmt, impl in runs:
            cmd = [sys.executable, __file__, "--child", impl, "--child-model", fmt.strip(), "--memory-tokens",
                   str(args.memory_tokens), "--tokens", str(args.tokens), "--decode-steps", str(args.decode_steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
            mem_rows.append({"format": fmt.strip(), "store": impl, **json.loads(out.stdout.strip().splitlines()[-1])})
        if not args.json:
            print(f"\nembedded SmolLM2, {args.memory_tokens}-token prefill in chunks of {args.tokens} + "
                  f"{args.decode_steps} decode steps, fresh process each, MB")
            print("| format | store | RSS | RSS growth | pools | growth less pools | heap free (fordblks) | "
                  "growth less pools after malloc_trim(0) |")
            print("|---|---|---|---|---|---|---|---|")
            for r in mem_rows:
                print(f"| {r['format']} | {r['store']} | {r['rss_mb']:.0f} | {r['growth_mb']:.1f} | {r['pools_mb']:.1f} | "
                      f"{r['growth_less_pools_mb']:.1f} | {r['fordblks_mb']:.1f} | "
                      f"{r['growth_less_pools_after_trim_mb']:.1f} |")
    if args.json:
        print(json.dumps({"codecs": rows, "model": model_rows, "model_memory": mem_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
