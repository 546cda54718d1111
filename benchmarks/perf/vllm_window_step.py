"""One decode step's attention with a recent window in vLLM's backend, 30 layers of one group.

    .venv-vllm/bin/python benchmarks/perf/vllm_window_step.py [--cases 16x250,16x1k,1x250] [--reps 31]

`impl.attend_recent` as vLLM's layers call it (one metadata object and one tail table tensor per
step) over turbo3 pages (block 32) and a q8_0 r64s16 tail (block 16), SmolLM2's shape (9 query
heads, 3 KV heads, head_dim 64), key and value centres set. Side by side in one process,
interleaved, thread CPU time of a step (30 calls), 1 thread, median of the reps:
- every layer validates: each call gets a fresh metadata object (what every layer did before the
  step's record, 346e5df);
- once per step: the calls share one metadata object (the step's first layer validates);
- plain turbo3: `impl.attend` without a window, for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, os.path.join(ROOT, "tests"))

LAYERS = 30


def measure(batch: int, length: int, reps: int) -> dict:
    from helpers.attention_oracle import make_case

    from pagedkv.codecs import get_codec
    from pagedkv.integrations.vllm import impl
    from pagedkv.integrations.vllm.backend import PagedKVMetadata
    from pagedkv.ops import AttentionParams
    from pagedkv.spec import RecentWindow

    lens = (length,) * batch
    kw = dict(seq_lens=lens, num_kv_heads=3, group=3, centre=True)
    main = make_case(get_codec("turbo3"), get_codec("turbo3"), block_size=32, seed=1, **kw)
    tail = make_case(get_codec("q8_0"), get_codec("q8_0"), block_size=16, seed=2, **kw)
    window = RecentWindow(64, "q8_0", sinks=16)
    params = AttentionParams(scale=0.125)
    seq = torch.tensor(lens, dtype=torch.int32)
    q, out = main.q_decode, torch.empty_like(main.q_decode)

    def metadata():
        empty = torch.zeros(0, dtype=torch.int32)
        return PagedKVMetadata(num_actual_tokens=batch, num_decodes=batch, decode_block_tables=main.block_tables,
                               decode_seq_lens=seq, prefill_block_tables=main.block_tables[:0],
                               prefill_seq_lens=empty, prefill_query_start=torch.zeros(1, dtype=torch.int32))

    def every():
        for _ in range(LAYERS):
            impl.attend_recent(main.layer, tail.layer, tail.block_tables, window, params, q, out, metadata())

    def once():
        m = metadata()
        for _ in range(LAYERS):
            impl.attend_recent(main.layer, tail.layer, tail.block_tables, window, params, q, out, m)

    def plain():
        m = metadata()
        for _ in range(LAYERS):
            impl.attend(main.layer, params, q, out, m)

    runs = {"every": every, "once": once, "plain": plain}
    times = {k: [] for k in runs}
    for _ in range(reps + 1):  # the first round warms up
        for k, fn in runs.items():
            t = time.thread_time()
            fn()
            times[k].append(time.thread_time() - t)
    return {k: 1e3 * statistics.median(v[1:]) for k, v in times.items()} | {"load": os.getloadavg()[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="16x250,16x1k,1x250", help="BATCHxLENGTH, comma separated")
    p.add_argument("--reps", type=int, default=31)
    args = p.parse_args(argv)
    from pagedkv.cli.sizes import parse_counts

    torch.set_num_threads(1)
    print(f"turbo3 pages + q8_0 r64s16 tail, {LAYERS} layers per step, 1 thread, ms per step "
          f"(thread CPU time, median of {args.reps})")
    print("| batch x length | every layer validates | once per step | once / every | plain turbo3 | load |")
    print("|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        b, _, n = case.partition("x")
        r = measure(int(b), parse_counts(n, "--cases")[0], args.reps)
        print(f"| {int(b)} x {n} | {r['every']:.2f} | {r['once']:.2f} | {r['once'] / r['every']:.2f} | "
              f"{r['plain']:.2f} | {r['load']:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
