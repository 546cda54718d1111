"""Decode (and prefill) attention speed on the compressed paged cache vs torch over bf16.

Everything runs side by side in one process on a model-shaped cache (default `BenchShape`: the
embedded model's shape, 30 layers, 9 q heads, 3 kv heads, head_dim 64, block size 16):
- ours: `pagedkv.ops.cpu.attention` (the fused C kernel) over paged pools of each format;
- baseline: the FASTEST of three torch ways over a contiguous bf16 cache [B, H, n, D] of the same
  shape: SDPA with enable_gqa, SDPA with the GQA group folded into the query length, and plain
  bf16 matmul -> fp32 softmax -> matmul with the group folded.

Timing: `timed_layers` distinct layers (each its own memory) are run back to back per repeat and
the per-layer median over repeats is scaled to `layers`; within a (context, batch) point every
contender (the three torch ways and each format) is timed once per repeat, interleaved, so that
they all see the same machine conditions (other processes on a shared machine); `timed_layers` is chosen so the timed
bytes exceed 4x the L3 cache (the reads come from DRAM, as in a real 30-layer step) within a
memory budget. Contents: a few real encoded blocks (random N(0,1) K/V through the reference
store) tiled over the pools, randomly permuted block tables.

Memory: with `huge_pages` (default) both sides' decode caches (our pools, torch's bf16 K/V) go on
2 MiB pages where the OS allows (`ops.hugepages.advise`): random block order costs a TLB miss per
block on 4 KiB pages once the pools outgrow the TLB's reach, which the contiguous torch cache
barely feels (32k batch 8, turbo3: ours 0.90x, the baseline 0.95x the time with huge pages).

Clock: with one thread (the default) the calling thread's CPU time (`time.thread_time`), since
both sides compute in that thread and its CPU time leaves out the time the OS gives to other
processes on a shared machine; wall time with more threads (rows say which).

Each row: format, context, batch, ms (per decode step over all layers), baseline_ms, ratio =
ms / baseline_ms, gbps (effective GB/s of the K/V bytes a step reads), plus the baseline ways,
the bytes per step and the timed layer count.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..formats import KVFormat, parse_format
from ..ops import AttentionParams, PagedLayer, hugepages, make_layer
from ..ops.reference import store as reference_store
from .config import BenchShape, check_prefill_shapes

L3_BYTES = 32 << 20
SEED_TOKENS = 1024


def _timed_layers(shape: BenchShape, layer_bytes: int) -> int:
    want = max(2, math.ceil(4 * L3_BYTES / max(layer_bytes, 1)))
    fit = max(1, shape.memory_budget // max(layer_bytes, 1))
    return max(1, min(shape.layers, want, fit))


def _seeded_layers(fmt: KVFormat, shape: BenchShape, num_blocks: int, count: int,
                   huge_pages: bool = False) -> list[PagedLayer]:
    """`count` layers of `num_blocks` blocks filled with tiled real encoded blocks (pools on huge
    pages if asked: the decode grid, whose torch side gets them too)."""
    h, d, bs = shape.num_kv_heads, shape.head_dim, shape.block_size
    seed_blocks = min(num_blocks, max(1, SEED_TOKENS // bs))
    gen = torch.Generator().manual_seed(1234)
    k = torch.randn(seed_blocks * bs, h, d, generator=gen)
    v = torch.randn(seed_blocks * bs, h, d, generator=gen)
    seed = make_layer(fmt.k, fmt.v, seed_blocks, bs, h, d)
    reference_store(seed, k, v, torch.arange(seed_blocks * bs))
    layers = []
    for _ in range(count):
        layer = make_layer(fmt.k, fmt.v, num_blocks, bs, h, d)
        if huge_pages:
            hugepages.advise(layer.k_pool)
            hugepages.advise(layer.v_pool)
        for src, dst in ((seed.k_pool, layer.k_pool), (seed.v_pool, layer.v_pool)):
            reps = -(-num_blocks // seed_blocks)
            dst.copy_(src.repeat(reps, 1)[:num_blocks])
        layers.append(layer)
    return layers


def layer_bytes(fmt: KVFormat, shape: BenchShape, tokens: int) -> int:
    """K + V bytes of `tokens` tokens of one layer (what a decode step reads per layer)."""
    h, d = shape.num_kv_heads, shape.head_dim
    return tokens * h * (fmt.k.row_bytes(d) + fmt.v.row_bytes(d))


def machine_load() -> float:
    """The 1-minute load average (runnable processes; the machine is shared): printed beside
    timings, since wall-clock rows (threads > 1) are only meaningful when it is below the cores."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# ---------------------------------------------------------------------------- decode contenders
@dataclass
class Contender:
    """One way to run a decode step: fn(i) runs layer i of `timed_layers`; bytes read per step."""

    name: str
    fn: Callable[[int], object]
    timed_layers: int
    bytes_per_step: int
    times: list = field(default_factory=list)  # per-layer seconds, one per repeat

    def time_once(self, clock: Callable[[], float]) -> None:
        t = clock()
        for i in range(self.timed_layers):
            self.fn(i)
        self.times.append((clock() - t) / self.timed_layers)

    def step_ms(self, layers: int) -> float:
        return statistics.median(self.times) * 1e3 * layers


def baseline_contenders(shape: BenchShape, context: int, batch: int) -> list[Contender]:
    """The three torch ways over a contiguous bf16 cache [B, H, n, D] (bf16 q, group folded or
    enable_gqa); the fastest is the baseline."""
    h, hq, d = shape.num_kv_heads, shape.num_q_heads, shape.head_dim
    g = hq // h
    per_layer = 2 * batch * h * context * d * 2
    n = _timed_layers(shape, per_layer)
    gen = torch.Generator().manual_seed(7)
    ks = [torch.randn(batch, h, context, d, generator=gen).to(torch.bfloat16) for _ in range(n)]
    vs = [torch.randn(batch, h, context, d, generator=gen).to(torch.bfloat16) for _ in range(n)]
    if shape.huge_pages:
        for t in ks + vs:
            hugepages.advise(t)
    q = torch.randn(batch, hq, 1, d, generator=gen).to(torch.bfloat16)
    qf = q.reshape(batch, h, g, d)  # group folded into the query length
    scale = d ** -0.5

    def sdpa_gqa(i):
        return F.scaled_dot_product_attention(q, ks[i], vs[i], scale=scale, enable_gqa=True)

    def sdpa_folded(i):
        return F.scaled_dot_product_attention(qf, ks[i], vs[i], scale=scale)

    def matmul_folded(i):
        s = torch.matmul(qf, ks[i].transpose(-1, -2)).float() * scale
        return torch.matmul(torch.softmax(s, -1).to(torch.bfloat16), vs[i])

    return [Contender(name, fn, n, per_layer * shape.layers)
            for name, fn in (("sdpa_gqa", sdpa_gqa), ("sdpa_folded", sdpa_folded), ("matmul_folded", matmul_folded))]


def ours_contenders(fmt: KVFormat, shape: BenchShape, context: int, batch: int, attention: Callable,
                    ways: Sequence[dict] = ({},)) -> list[Contender]:
    """The fast kernel over paged pools of `fmt` (random block tables, bf16 q): one contender per
    `ways` entry, AttentionParams switches to set (`{}` exact, `{"int8_scores": True}`, ...), same pools."""
    bs = shape.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = blocks_per_seq * batch
    per_layer = layer_bytes(fmt, shape, context * batch)
    n = _timed_layers(shape, per_layer)
    layers = _seeded_layers(fmt, shape, num_blocks, n, huge_pages=shape.huge_pages)
    gen = torch.Generator().manual_seed(11)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, shape.num_q_heads, shape.head_dim, generator=gen).to(torch.bfloat16)

    def contender(params: AttentionParams) -> Contender:
        def step(i, threads=shape.threads):
            return attention(q, layers[i], tables, lens, qsl, params, num_threads=threads)

        return Contender(fmt.name, step, n, per_layer * shape.layers)

    return [contender(AttentionParams(scale=shape.head_dim ** -0.5, **kw)) for kw in ways]


def thread_scaling_point(fmt: KVFormat, shape: BenchShape, context: int, batch: int, attention: Callable,
                         threads: int) -> dict:
    """The kernel's own speed-up from more threads: the same decode step over the same pools at 1
    and at `threads` threads, timed once per repeat each, interleaved, on the wall clock (CPU time
    would count every thread's work); speedup = ms at 1 thread / ms at `threads`. The machine load
    is printed beside it: on a shared machine other processes take cores from the wider run."""
    one = ours_contenders(fmt, shape, context, batch, attention)[0]
    wide = Contender(fmt.name, lambda i: one.fn(i, threads=threads), one.timed_layers, one.bytes_per_step)
    for c in (one, wide):
        c.fn(0)
    load_before = machine_load()
    for _ in range(shape.repeats):
        for c in (one, wide):
            c.time_once(time.perf_counter)
    ms1, msn = one.step_ms(shape.layers), wide.step_ms(shape.layers)
    return {"format": fmt.name, "context": context, "batch": batch, "threads": threads, "ms_1": ms1,
            "ms_n": msn, "speedup": ms1 / msn, "repeats": shape.repeats, "timed_layers": one.timed_layers,
            "layers": shape.layers, "load_before": load_before, "load": machine_load(), "cores": os.cpu_count()}


def decode_grid_point(fmts: list[KVFormat], shape: BenchShape, context: int, batch: int,
                      attention: Callable, int8_scores: bool = False, bf16_dots: bool = False) -> list[dict]:
    """Rows for one (context, batch): every contender timed once per repeat, interleaved, so the
    baseline and each format see the same machine conditions; medians over repeats. int8_scores:
    each format also with the approximate integer q.k (rows with "scores": "int8"); bf16_dots: also
    with bf16 products (rows with "scores": "bf16"; a K codec without a bf16 path computes exactly)."""
    base = baseline_contenders(shape, context, batch)
    ways = [("fp32", {})] + [(n, {k: True}) for n, k, on in (("int8", "int8_scores", int8_scores),
                                                             ("bf16", "bf16_dots", bf16_dots)) if on]
    per_fmt = [ours_contenders(f, shape, context, batch, attention, [kw for _, kw in ways]) for f in fmts]
    ours = [cs[w] for w in range(len(ways)) for cs in per_fmt]  # the grid's order: by way, then format
    scores = [n for n, _ in ways for _ in fmts]
    everyone = base + ours
    for c in everyone:  # warm-up: first touch, allocator, thread pool
        c.fn(0)
    clock = shape.timer()
    for _ in range(shape.repeats):
        for c in everyone:
            c.time_once(clock)
    ways = {c.name: c.step_ms(shape.layers) for c in base}
    best = min(base, key=lambda c: ways[c.name])
    rows = []
    for c, sc in zip(ours, scores):
        ms = c.step_ms(shape.layers)
        rows.append({"format": c.name, "scores": sc, "context": context, "batch": batch, "ms": ms,
                     "baseline_ms": ways[best.name], "ratio": ms / ways[best.name],
                     "gbps": c.bytes_per_step / (ms / 1e3) / 1e9,
                     "baseline_gbps": best.bytes_per_step / (ways[best.name] / 1e3) / 1e9,
                     "baseline": best.name, "baseline_ways": ways,
                     "bytes_per_step": c.bytes_per_step, "timed_layers": c.timed_layers,
                     "baseline_timed_layers": best.timed_layers, "layers": shape.layers,
                     "threads": shape.threads, "repeats": shape.repeats, "load": machine_load(),
                     "clock": "thread_cpu" if clock is time.thread_time else "wall"})
    return rows


def peak_memory_decode(fmt: KVFormat, shape: BenchShape, context: int, attention: Callable,
                       with_reference: bool = False) -> dict:
    """Peak resident memory added by one decode step of one layer at `context` (batch 1).

    Linux: resets the peak-RSS mark (/proc/self/clear_refs) and reads VmHWM after the call. The
    compressed cache itself is allocated (and touched) before the mark.
    """
    bs = shape.block_size
    nb = -(-context // bs)
    layer = _seeded_layers(fmt, shape, nb, 1)[0]
    tables = torch.arange(nb, dtype=torch.int32).reshape(1, nb)
    lens = torch.tensor([context], dtype=torch.int32)
    qsl = torch.arange(2, dtype=torch.int32)
    q = torch.randn(1, shape.num_q_heads, shape.head_dim).to(torch.bfloat16)
    params = AttentionParams(scale=shape.head_dim ** -0.5)
    cache_bytes = layer.k_pool.numel() + layer.v_pool.numel()
    attention(q, layer, tables, lens, qsl, params, num_threads=shape.threads)  # warm-up

    def status_kb(key: str) -> Optional[int]:
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith(key + ":"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return {"format": fmt.name, "context": context, "cache_mb": cache_bytes / 2**20, "peak_extra_mb": None}

    def peak_of(fn) -> Optional[float]:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # peak RSS mark := current RSS
        before = status_kb("VmRSS")
        fn()
        peak = status_kb("VmHWM")
        return (peak - before) / 1024 if peak and before else None

    row = {"format": fmt.name, "context": context, "cache_mb": cache_bytes / 2**20,
           "peak_extra_mb": peak_of(lambda: attention(q, layer, tables, lens, qsl, params,
                                                      num_threads=shape.threads)),
           "fp32_context_copy_mb": 2 * context * shape.num_kv_heads * shape.head_dim * 4 / 2**20}
    if with_reference:  # the gather-and-decode oracle, to show what the measurement catches
        from ..ops.reference import decode_attention as ref_decode

        row["reference_peak_extra_mb"] = peak_of(lambda: ref_decode(q, layer, tables, lens, params))
    return row


def prefill_row(fmt: KVFormat, shape: BenchShape, context: int, q_len: int, attention: Callable) -> dict:
    """One chunked-prefill step (q_len queries at the end of `context`, batch 1) vs torch SDPA
    over bf16 with the same bottom-right causal mask (fastest of enable_gqa / expanded K,V), each
    timed once per repeat, interleaved, so that all see the same machine conditions."""
    h, hq, d, bs = shape.num_kv_heads, shape.num_q_heads, shape.head_dim, shape.block_size
    g = hq // h
    nb = -(-context // bs)
    n = 2
    reps = max(2, min(shape.repeats, 3))
    layers = _seeded_layers(fmt, shape, nb, n)
    tables = torch.arange(nb, dtype=torch.int32).reshape(1, nb)
    lens = torch.tensor([context], dtype=torch.int32)
    qsl = torch.tensor([0, q_len], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(q_len, hq, d, generator=gen).to(torch.bfloat16)
    params = AttentionParams(scale=d ** -0.5)
    kb = [torch.randn(1, h, context, d, generator=gen).to(torch.bfloat16) for _ in range(n)]
    vb = [torch.randn(1, h, context, d, generator=gen).to(torch.bfloat16) for _ in range(n)]
    ke = [k.repeat_interleave(g, dim=1) for k in kb]
    ve = [v.repeat_interleave(g, dim=1) for v in vb]
    qb = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    pos = torch.arange(context - q_len, context)
    mask = torch.arange(context)[None, :] <= pos[:, None]
    # timed interleaved, once per repeat each (as the decode grid): the same machine conditions
    everyone = [
        Contender("ours", lambda i: attention(q, layers[i], tables, lens, qsl, params,
                                              num_threads=shape.threads), n, 0),
        Contender("sdpa_gqa", lambda i: F.scaled_dot_product_attention(
            qb, kb[i], vb[i], attn_mask=mask, scale=d ** -0.5, enable_gqa=True), n, 0),
        Contender("sdpa_expanded", lambda i: F.scaled_dot_product_attention(
            qb, ke[i], ve[i], attn_mask=mask, scale=d ** -0.5), n, 0),
    ]
    for c in everyone:
        c.fn(0)
    clock = shape.timer()
    for _ in range(reps):
        for c in everyone:
            c.time_once(clock)
    ms = everyone[0].step_ms(shape.layers)
    ways = {c.name: c.step_ms(shape.layers) for c in everyone[1:]}
    best = min(ways, key=ways.get)
    return {"format": fmt.name, "context": context, "q_len": q_len, "ms": ms, "baseline_ms": ways[best],
            "ratio": ms / ways[best], "baseline": best, "baseline_ways": ways,
            "threads": shape.threads, "load": machine_load()}


# ---------------------------------------------------------------------------- driver
@dataclass
class BenchResult:
    rows: list = field(default_factory=list)
    prefill: list = field(default_factory=list)
    memory: list = field(default_factory=list)
    scaling: list = field(default_factory=list)
    bandwidth_gbps: Optional[float] = None
    kernel: dict = field(default_factory=dict)


def run(formats: list[str], contexts: list[int], batches: list[int], shape: BenchShape, *,
        prefill: bool = True, memory: bool = True, progress: Optional[Callable[[str], None]] = None,
        prefill_shapes: tuple = ((4096, 512),), bandwidth_bytes: int = 1 << 29,
        int8_scores: bool = False, scaling_threads: Optional[int] = None, decode: bool = True,
        bf16_dots: bool = False) -> BenchResult:
    """Run the benchmark grid; formats are KV format names (parsed here, the config edge).
    int8_scores: decode rows also with the approximate integer q.k; bf16_dots: decode rows also
    with bf16 products (`AttentionParams.bf16_dots`). scaling_threads: also a
    thread-scaling row (1 vs that many threads, wall clock) per format, context and batch.
    decode: False skips the decode grid (prefill, scaling and memory rows only).

    prefill_shapes: (context, query count) of each chunked-prefill row (q_len queries at the end
    of the context); bandwidth_bytes: buffer of the streaming-read probe (larger than the caches)."""
    shape.check()
    check_prefill_shapes(prefill_shapes)
    if scaling_threads is not None and (isinstance(scaling_threads, bool) or not isinstance(scaling_threads, int)
                                        or scaling_threads < 2):
        raise ConfigError(f"scaling threads must be an integer >= 2, got {scaling_threads!r}")
    fmts = [parse_format(f) for f in formats]
    for c in contexts + batches:
        if not isinstance(c, int) or c < 1:
            raise ConfigError(f"contexts and batch sizes must be positive integers, got {c!r}")
    from ..ops import cpu

    if not cpu.available():
        raise ConfigError(f"the fast CPU attention kernel is not available: {cpu.kernel_info().get('error')}")
    torch.set_num_threads(shape.threads)
    res = BenchResult(kernel=cpu.kernel_info())
    res.bandwidth_gbps = cpu.stream_read_gbps(bandwidth_bytes, threads=shape.threads)
    say = progress or (lambda s: None)
    for batch in batches if decode else ():
        for context in contexts:
            for row in decode_grid_point(fmts, shape, context, batch, cpu.attention, int8_scores, bf16_dots):
                res.rows.append(row)
                say(f"{row['format']:>14} {row['scores']} ctx {context:>6} batch {batch}: {row['ms']:.1f} ms vs "
                    f"{row['baseline_ms']:.1f} ms ({row['baseline']}) ratio {row['ratio']:.2f}, "
                    f"{row['gbps']:.2f} GB/s, {shape.threads} thread(s), load {row['load']:.1f}")
    if scaling_threads is not None:
        torch.set_num_threads(max(shape.threads, scaling_threads))
        for batch in batches:
            for context in contexts:
                for fmt in fmts:
                    s = thread_scaling_point(fmt, shape, context, batch, cpu.attention, scaling_threads)
                    res.scaling.append(s)
                    say(f"{fmt.name:>14} ctx {context:>6} batch {batch}: 1 thread {s['ms_1']:.1f} ms, "
                        f"{scaling_threads} threads {s['ms_n']:.1f} ms, speed-up {s['speedup']:.2f}x (wall), "
                        f"load {s['load_before']:.1f}-{s['load']:.1f} on {s['cores']} cores")
        torch.set_num_threads(shape.threads)
    if prefill:
        for context, q_len in prefill_shapes:
            for fmt in fmts:
                res.prefill.append(prefill_row(fmt, shape, context, q_len, cpu.attention))
                p = res.prefill[-1]
                say(f"prefill {fmt.name:>14} {q_len} after {context - q_len}: {p['ms']:.0f} ms vs "
                    f"{p['baseline_ms']:.0f} ms ratio {p['ratio']:.2f}, {p['threads']} thread(s), load {p['load']:.1f}")
    if memory:
        for i, fmt in enumerate(fmts):
            res.memory.append(peak_memory_decode(fmt, shape, max(contexts), cpu.attention, with_reference=i == 0))
    return res
