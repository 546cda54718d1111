"""Peak resident memory of a long generation, pagedkv cache vs the same run in bf16.

    python -m pagedkv.eval.memory --format turbo3 --context 16384 --new-tokens 16

Each run is its own process (peak RSS is per process): the embedded model builds a `--context`
token context from the default text in chunks of `--chunk` tokens (chunked prefill: every chunk
attends to the compressed pages of the earlier ones), then greedily decodes `--new-tokens`. The
cache is preallocated for the whole run (`max_tokens`) so pool growth does not distort the peak.
Prints one JSON line: format, tokens, KV bytes in use, RSS after loading, the peak RSS of the
generation itself (VmHWM after resetting it post-load) and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> int:
    """Free what the load left behind, reset the kernel's peak-RSS mark (Linux: clear_refs 5);
    returns the resident bytes at that point."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_bytes("VmRSS")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--format", default="turbo3")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from ..integrations.transformers import PagedKVCache
    from .model import load_model, resolve_model_source
    from .runner import parse_choice
    from .text import bos_id, default_text, tokenize

    if args.threads:
        torch.set_num_threads(args.threads)
    choice = parse_choice(args.format)
    lm = load_model(resolve_model_source(None), attn_implementation="pagedkv")
    toks = tokenize(lm.tokenizer, default_text())[: args.context - 1]
    ids = torch.cat([torch.tensor([bos_id(lm.tokenizer) or 0]), toks])[None]
    rss_model = _reset_peak()  # the load's own peak (GGUF dequantization) must not count
    cache = PagedKVCache(lm.model, choice.kv_format, high_precision_layers=choice.high_precision_layers,
                         max_tokens=args.context + args.new_tokens, checks=False)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, ids.shape[1], args.chunk):
            last = lm.model(ids[:, start:start + args.chunk], cache=cache, use_cache=True).logits[:, -1]
        t_prefill = time.perf_counter() - t0
        tok = last.argmax(-1, keepdim=True)  # greedy decode continuing the cache
        step_times = []
        for _ in range(args.new_tokens):
            t = time.perf_counter()
            tok = lm.model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            step_times.append(time.perf_counter() - t)
    peak = _status_bytes("VmHWM")
    step_times.sort()
    print(json.dumps({
        "format": choice.label, "tokens": cache.get_seq_length(), "kv_bytes_used": cache.used_bytes(),
        "kv_pool_bytes": cache.pool_bytes(), "peak_rss_bytes": peak, "rss_after_load_bytes": rss_model,
        "peak_minus_load_bytes": peak - rss_model,
        "prefill_s": round(t_prefill, 1), "decode_median_s": step_times[len(step_times) // 2] if step_times else None,
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
