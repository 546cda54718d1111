"""One layer's attention work per serving step, vLLM's CPU_ATTN against the pagedkv backend, side by side.

    .venv-vllm/bin/python benchmarks/perf/vllm_attention_step.py [--threads 1] [--formats turbo3,fp8k_turbo3v]

What one attention layer does per step inside a vLLM engine (SmolLM2-135M shape: 9 query heads,
3 KV heads, head_dim 64; vLLM's CPU block size 128), timed without the rest of the model so the
attention backend's own cost, and its Python overhead, are visible:
- vLLM bf16: `cpu_attn_reshape_and_cache` of the step's tokens, then `cpu_attention_with_kv_cache`
  (its scheduler metadata, built once per step for all layers, is built outside the timing);
- pagedkv FORMAT: the backend's own per-layer calls (`impl.store_new` / `impl.attend`, what
  `do_kv_cache_update` / `forward` run) on a page laid out as vLLM allocates it, with
  fitted-like statistics (key / value centres), the step's metadata built once (`split_rows`)
  and reused, as by the 2nd..30th layer of a step (validated by the first; the warm-up round).
Cases: decode batches (B sequences of L cached tokens, one new token each) and one prefill chunk.
Medians of --reps runs (1 thread: the thread's CPU time; more: wall-clock), each case's
configurations interleaved in one process; ratios to vLLM bf16. The machine is shared: read the ratios, and quote the load (`uptime`).
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

HQ, H, D, BS = 9, 3, 64, 128


def _tables(lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    per = max((n + BS - 1) // BS for n in lens)
    perm = torch.randperm(num_blocks, generator=gen)[: per * len(lens)].to(torch.int32)
    return perm.view(len(lens), per).contiguous()


def _slots(tables: torch.Tensor, lens: list[int], q_lens: list[int]) -> torch.Tensor:
    out = []
    for b, (n, q) in enumerate(zip(lens, q_lens)):
        pos = torch.arange(n - q, n)
        out.append(tables[b, pos // BS].long() * BS + pos % BS)
    return torch.cat(out)


class VllmBf16:
    """vLLM's own CPU backend over a bf16 cache [blocks, H, 2*BS, D] (K then V per block)."""

    def __init__(self, num_blocks: int):
        from vllm import _custom_ops as vops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        self.ops = vops
        self.isa = _get_attn_isa(torch.bfloat16, BS, D, "auto")
        cache = torch.zeros(num_blocks, H, 2 * BS, D, dtype=torch.bfloat16)
        self.k_cache, self.v_cache = cache.chunk(2, dim=2)

    def prepare(self, lens, qsl, tables, nd):
        seq = torch.tensor(lens, dtype=torch.int32)
        meta = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(lens), num_heads=HQ, num_kv_heads=H, head_dim=D, seq_lens=seq, dtype=torch.bfloat16,
            query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=self.isa, enable_kv_split=False)
        return seq, meta

    def store(self, k, v, slots, prep):
        self.ops.cpu_attn_reshape_and_cache(k, v, self.k_cache, self.v_cache, slots, self.isa)

    def attend(self, q, out, tables, qsl, prep):
        seq, meta = prep
        self.ops.cpu_attention_with_kv_cache(
            query=q.view(-1, HQ, D), key_cache=self.k_cache, value_cache=self.v_cache, output=out.view(-1, HQ, D),
            query_start_loc=qsl,
            seq_lens=seq, scale=D ** -0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=tables, softcap=0.0, scheduler_metadata=meta, s_aux=None)


class Paged:
    """The pagedkv backend's per-layer calls (impl.py) on a vLLM-shaped uint8 page."""

    def __init__(self, fmt_name: str, num_blocks: int, gen: torch.Generator):
        from pagedkv.formats import parse_format
        from pagedkv.cache.calibration import Calibration
        from pagedkv.integrations.vllm.layout import content_bytes, paged_layer
        from pagedkv.ops.batch import AttentionParams

        fmt = parse_format(fmt_name)
        page = torch.zeros(num_blocks, H, BS, content_bytes(fmt, D), dtype=torch.uint8)
        cal = Calibration(k_centre=torch.randn(H, D, generator=gen),
                          v_centre=0.1 * torch.randn(H, D, generator=gen),
                          k_scale=torch.ones(1), v_scale=torch.ones(1))
        self.layer = paged_layer(page, fmt, H, D, cal)
        self.params = AttentionParams(scale=D ** -0.5)

    def prepare(self, lens, qsl, tables, nd):
        from pagedkv.integrations.vllm.backend import split_rows

        return split_rows(qsl, torch.tensor(lens, dtype=torch.int32), tables, nd, int(qsl[-1]))

    def store(self, k, v, slots, prep):
        from pagedkv.integrations.vllm.impl import store_new

        store_new(self.layer, k, v, slots, prep)

    def attend(self, q, out, tables, qsl, prep):
        from pagedkv.integrations.vllm.impl import attend

        attend(self.layer, self.params, q.view(-1, HQ, D), out.view(-1, HQ, D), prep)


def run_case(name, lens, q_lens, formats, reps, gen, clock=time.perf_counter):
    num_blocks = len(lens) * max((n + BS - 1) // BS for n in lens) + 8
    tables = _tables(lens, num_blocks, gen)
    slots = _slots(tables, lens, q_lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    t = int(qsl[-1])
    q = torch.randn(t, HQ * D, generator=gen).to(torch.bfloat16)
    k = torch.randn(t, H, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(t, H, D, generator=gen).to(torch.bfloat16)
    out = torch.empty(t, HQ * D, dtype=torch.bfloat16)
    # fill the whole context first (every token stored), as a running engine's pages are
    full = _slots(tables, lens, lens)
    kf = torch.randn(full.numel(), H, D, generator=gen).to(torch.bfloat16)
    vf = torch.randn(full.numel(), H, D, generator=gen).to(torch.bfloat16)
    runs = {"vllm-bf16": VllmBf16(num_blocks)}
    runs["vllm-bf16"].ops.cpu_attn_reshape_and_cache(kf, vf, runs["vllm-bf16"].k_cache,
                                                     runs["vllm-bf16"].v_cache, full, runs["vllm-bf16"].isa)
    for f in formats:
        p = Paged(f, num_blocks, gen)
        from pagedkv import ops

        ops.store(p.layer, kf, vf, full, checks=False)
        runs[f"pagedkv-{f}"] = p
    nd = sum(1 for x in q_lens if x == 1)
    preps = {n: r.prepare(lens, qsl, tables, nd) for n, r in runs.items()}
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in runs}
    for _ in range(reps + 1):  # the first round warms up
        for n, r in runs.items():
            t0 = clock()
            r.store(k, v, slots, preps[n])
            t1 = clock()
            r.attend(q, out, tables, qsl, preps[n])
            times[n].append((t1 - t0, clock() - t1))
    rows = []
    base = None
    for n, ts in times.items():
        st = statistics.median(a for a, _ in ts[1:]) * 1e3
        at = statistics.median(b for _, b in ts[1:]) * 1e3
        tot = statistics.median(a + b for a, b in ts[1:]) * 1e3
        base = base or tot
        rows.append((name, n, st, at, tot, tot / base))
    return rows


CASES = {
    "decode b8 x 256": ([256] * 8, [1] * 8),
    "decode b32 x 512": ([512] * 32, [1] * 32),
    "decode b8 x 1k": ([1000] * 8, [1] * 8),
    "decode b2 x 2k": ([2000] * 2, [1] * 2),
    "decode b1 x 8k": ([8192], [1]),
    "decode b8 x 8k": ([8192] * 8, [1] * 8),
    "decode b1 x 16k": ([16384], [1]),
    "decode b8 x 16k": ([16384] * 8, [1] * 8),
    "prefill 1k chunk": ([1000], [1000]),
    "mixed: 7 decodes 1k + 512-token chunk": ([1000] * 7 + [1536], [1] * 7 + [512]),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--formats", default="turbo3,fp8k_turbo3v")
    p.add_argument("--cases", default="decode b8 x 1k,decode b2 x 2k,prefill 1k chunk,mixed: 7 decodes 1k + 512-token chunk")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    formats = [f for f in args.formats.split(",") if f]
    # one thread: the thread's CPU time (what the work costs, whatever the machine's load);
    # more: wall-clock time (the OpenMP workers' time and their waits are the point)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print(f"one attention layer per step (Hq {HQ}, H {H}, D {D}, block {BS}), {args.threads} thread(s), "
          f"medians of {args.reps} ({'thread CPU' if args.threads == 1 else 'wall-clock'} time); "
          f"load {os.getloadavg()[0]:.1f}")
    print("| case | config | store ms | attention ms | ms / layer-step | x vLLM bf16 |")
    print("|---|---|---|---|---|---|")
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if name not in CASES:
            p.error(f"--cases: unknown {name!r}; accepted: {', '.join(CASES)}")
        for case, cfg, st, at, tot, ratio in run_case(name, *CASES[name], formats, args.reps, gen, clock):
            print(f"| {case} | {cfg} | {st:.3f} | {at:.3f} | {tot:.3f} | {ratio:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
