"""Decode-step time of a capped PagedCache vs the same run uncapped (same tokens required).

    .venv/bin/python benchmarks/perf/offload_swap_step.py

Toy model (pagedkv.bench.toy) over q8_0, 8 layers x 4 KV heads x 128, a 1024-token prompt, then
decode; cap = 8 resident blocks of 65. Prints median ms per decode step (1 thread) for: uncapped,
swap in memory, swap file without and with prefetch, and uncapped again (the machine is shared:
compare the two uncapped numbers to judge the noise).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

from pagedkv.cache import CacheConfig, PagedCache
from pagedkv.offload import OffloadConfig
from pagedkv.bench.toy import ToyLM

torch.set_num_threads(1)
CFG = CacheConfig(num_layers=8, num_kv_heads=4, head_dim=128, kv_format="q8_0", block_size=16,
                  num_blocks=160, high_precision_layers=0)
PROMPT = [i % 97 for i in range(1024)]


def run(cache, steps: int = 16):
    m = ToyLM(cache)
    new = cache.add_sequence(PROMPT)
    sid = new.seq_id
    logits, _ = m.forward(PROMPT, [sid], new.slot_mapping,
                          torch.tensor([0, len(PROMPT)], dtype=torch.int32))
    cache.commit(sid)
    tok, times, toks = int(logits[-1].argmax()), [], []
    for _ in range(steps):
        t = time.perf_counter()
        b = cache.step([sid], [[tok]])
        logits, _ = m.forward([tok], [sid], b.slot_mapping, None)
        cache.commit(sid)
        times.append(time.perf_counter() - t)
        tok = int(logits[-1].argmax())
        toks.append(tok)
    return statistics.median(times[2:]), toks


def main() -> None:
    base_t, base_toks = run(PagedCache(CFG))
    print(f"uncapped: {base_t * 1e3:.1f} ms/step")
    with tempfile.TemporaryDirectory() as d:
        for swap, prefetch in (("memory", True), ("disk", False), ("disk", True)):
            tc = PagedCache(CFG, OffloadConfig(resident_blocks_per_seq=8, swap=swap,
                                                prefetch=prefetch, cache_dir=d))
            t, toks = run(tc)
            print(f"cap 8 blocks, swap={swap} prefetch={prefetch}: {t * 1e3:.1f} ms/step "
                  f"({t / base_t:.2f}x), same tokens: {toks == base_toks}, resident "
                  f"{tc.resident_blocks(0)[0]} of {len(tc.seqs.table(0))} blocks")
            tc.close()
    again, _ = run(PagedCache(CFG))
    print(f"uncapped again: {again * 1e3:.1f} ms/step")


if __name__ == "__main__":
    main()
