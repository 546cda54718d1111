"""Peak resident memory of a long generation, per KV format, against a baseline format.

    pagedkv bench memory --formats bf16,turbo3 --memory-context 16k --chunk 256
    python -m pagedkv.bench.memory --format turbo3 --context 16384      # one run, one JSON line

Each run is its own process (peak RSS is per process): the embedded model builds a `--context`
token context from the default text in chunks of `--chunk` tokens (chunked prefill: every chunk
attends to the compressed pages of the earlier ones), then greedily decodes `--new-tokens`
(logits of the last position only). The cache is preallocated for the whole run (`max_tokens`)
so pool growth does not distort the peak. A run reports the peak RSS of the generation itself:
VmHWM after resetting it post-load (the load's own peak, GGUF dequantization, does not count),
minus the RSS at that point. By default a short generation with the same shapes on a throwaway
cache of the same format runs first (see `measure`): one-time state is not the generation's memory.

glibc's malloc raises its mmap threshold (up to 32 MiB) and its trim threshold (up to 64 MiB)
each time a large block is freed, which the model load does many times; after that, medium
temporaries live on the heap and up to ~64 MiB of freed heap can stay resident, so which run
keeps how much is decided by allocation order: measured +-30 MB between two bf16 runs at 16k.
`malloc="fixed"` pins both thresholds to glibc's initial 128 KiB (mallopt, before torch loads)
so freed temporaries return to the system and runs compare what they actually hold;
`malloc="default"` measures the process as glibc leaves it. Linux + glibc only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Optional, Sequence

from .config import MemoryBench

MALLOC_MODES = ("fixed", "default")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> int:
    """Free what the load left behind, reset the kernel's peak-RSS mark (Linux: clear_refs 5);
    returns the resident bytes at that point."""
    import gc

    from ..heap import release_free_heap

    gc.collect()
    release_free_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def _fix_malloc_thresholds(nbytes: int = 128 * 1024) -> None:
    """Pin glibc's mmap and trim thresholds (mallopt M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), which
    also turns off their dynamic growth."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, nbytes)  # M_TRIM_THRESHOLD


def _generate(model, cache, ids, chunk: int, new_tokens: int) -> tuple[float, list[float]]:
    """Chunked prefill of ids [1, N] then greedy decode; (prefill seconds, decode step seconds)."""
    import torch

    from ..integrations.hf_compat import with_cache

    kw = with_cache(model, cache)  # resolved once, outside the timed calls
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, ids.shape[1], chunk):
            last = model(ids[:, start:start + chunk], **kw, use_cache=True,
                         logits_to_keep=1).logits[:, -1]
        t_prefill = time.perf_counter() - t0
        tok = last.argmax(-1, keepdim=True)  # greedy decode continuing the cache
        step_times = []
        for _ in range(new_tokens):
            t = time.perf_counter()
            tok = model(tok, **kw, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            step_times.append(time.perf_counter() - t)
    return t_prefill, step_times


def measure(fmt: str, context: int, chunk: int, new_tokens: int, threads: Optional[int],
            warmup: bool = True) -> dict:
    """One generation in this process (see the module docstring); returns the JSON row.

    warmup: first run a short generation with the same shapes (two chunks, two decode steps)
    on a throwaway cache of the same format, so one-time state (the code pages of the kernels the
    format uses: file-backed, shared, ~2 MB more for the turbo path than for bf16; the math
    libraries' per-shape buffers) exists before the peak is reset and does not count as the
    generation's memory. `rss_anon_bytes` / `rss_file_bytes`: growth of anonymous (data) and
    file-backed (code) resident memory from the reset to the end."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ..integrations.transformers import PagedKVCache
    from ..eval.model import load_model, resolve_model_source
    from ..eval.runner import parse_choice
    from ..eval.text import bos_id, default_text, tokenize

    if threads:
        torch.set_num_threads(threads)
    choice = parse_choice(fmt)
    lm = load_model(resolve_model_source(None), attn_implementation="pagedkv")
    toks = tokenize(lm.tokenizer, default_text())[: context - 1]
    ids = torch.cat([torch.tensor([bos_id(lm.tokenizer) or 0]), toks])[None]
    if warmup:
        n = min(2 * chunk, ids.shape[1])
        spare = PagedKVCache(lm.model, choice.kv_format, high_precision_layers=choice.high_precision_layers,
                             max_tokens=n + 2, checks=False)
        _generate(lm.model, spare, ids[:, :n], chunk, 2)
        del spare
    rss_model = _reset_peak()  # the load's own peak (GGUF dequantization) must not count
    anon0, file0 = _status_bytes("RssAnon"), _status_bytes("RssFile")
    cache = PagedKVCache(lm.model, choice.kv_format, high_precision_layers=choice.high_precision_layers,
                         max_tokens=context + new_tokens, checks=False)
    t_prefill, step_times = _generate(lm.model, cache, ids, chunk, new_tokens)
    peak = _status_bytes("VmHWM")
    step_times.sort()
    return {
        "format": choice.label, "tokens": cache.get_seq_length(), "kv_bytes_used": cache.used_bytes(),
        "kv_pool_bytes": cache.pool_bytes(), "peak_rss_bytes": peak, "rss_after_load_bytes": rss_model,
        "peak_minus_load_bytes": peak - rss_model, "warmup": warmup,
        "rss_anon_bytes": _status_bytes("RssAnon") - anon0, "rss_file_bytes": _status_bytes("RssFile") - file0,
        "prefill_s": round(t_prefill, 1), "decode_median_s": step_times[len(step_times) // 2] if step_times else None,
    }


def compare(formats: Sequence[str], context: int = MemoryBench.context, chunk: int = MemoryBench.chunk,
            new_tokens: int = MemoryBench.new_tokens, threads: Optional[int] = MemoryBench.threads,
            malloc: str = MemoryBench.malloc, warmup: bool = MemoryBench.warmup, progress=None) -> list[dict]:
    """Run `measure` for each format in a fresh process; rows gain the saving against the first
    format: `saved_bytes` (its peak_minus_load less ours), `kv_difference_bytes` (its KV pool less
    ours) and `saved_vs_kv` (their ratio: >= 1 means at least the KV difference was saved)."""
    from ..errors import ConfigError, PagedKVError

    if malloc not in MALLOC_MODES:
        raise ConfigError(f"malloc must be one of {', '.join(MALLOC_MODES)}, got {malloc!r}")
    if not formats:
        raise ConfigError("memory comparison needs at least one format")
    from ..eval.runner import parse_choice

    for f in formats:
        parse_choice(f)  # bad names fail here, before minutes of child runs
    rows = []
    for f in formats:
        if progress:
            progress(f"memory: {f}, {context} tokens in chunks of {chunk} (a fresh process) ...")
        cmd = [sys.executable, "-m", "pagedkv.bench.memory", "--format", f, "--context", str(context),
               "--chunk", str(chunk), "--new-tokens", str(new_tokens), "--malloc", malloc]
        if not warmup:
            cmd.append("--no-warmup")
        if threads:
            cmd += ["--threads", str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise PagedKVError(f"memory run for {f} failed (exit {proc.returncode}): {tail}")
        row = json.loads(lines[-1])
        row["malloc"] = malloc
        rows.append(row)
    base = rows[0]
    for r in rows:
        r["saved_bytes"] = base["peak_minus_load_bytes"] - r["peak_minus_load_bytes"]
        r["kv_difference_bytes"] = base["kv_pool_bytes"] - r["kv_pool_bytes"]
        r["saved_vs_kv"] = (round(r["saved_bytes"] / r["kv_difference_bytes"], 3)
                            if r["kv_difference_bytes"] else None)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="turbo3")
    p.add_argument("--context", type=int, default=MemoryBench.context)
    p.add_argument("--chunk", type=int, default=MemoryBench.chunk)
    p.add_argument("--new-tokens", type=int, default=MemoryBench.new_tokens)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--malloc", choices=MALLOC_MODES, default="fixed")
    p.add_argument("--no-warmup", action="store_true", help="count the first use of the format's kernels too")
    args = p.parse_args(argv)
    if args.malloc == "fixed":
        _fix_malloc_thresholds()
    print(json.dumps(measure(args.format, args.context, args.chunk, args.new_tokens, args.threads,
                             warmup=not args.no_warmup)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
