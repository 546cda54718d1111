"""Fast CPU attention on the compressed paged cache: a fused C kernel, compiled at first use.

Importing this module compiles (once, cached on disk, see `build.py`) and loads the kernel, then
registers the "cpu" backend with the ops dispatcher. Without a C compiler the import logs a
warning and registers nothing, so the dispatcher uses the reference ops.

Technique (chosen by measurement; the machine of those sessions: AMD EPYC with AVX-512
F/BW/VL/VBMI/BF16, a shared 2-core VM; `pagedkv bench attention`, 1 thread, the thread's CPU time, 30 layers x (9 q heads,
3 kv heads, head_dim 64), block size 16, random block tables, medians of 5):
- The kernel walks each sequence's blocks once (flash-decoding style, online softmax, fp32
  accumulation, GQA group folded: every query vector of a kv head shares each decoded K/V row),
  never building a full-precision copy of the context. It works on ~64-token chunks (several
  blocks): the scales of the chunk are decoded once for all kv heads, then per kv head the K rows
  are decoded into registers and dotted with each query (partials reduced 16 tokens at a time by
  a shuffle tree), the softmax state is updated, and the V rows still needed are decoded into
  registers and accumulated into register accumulators. Prefill on AVX2 and AVX-512 builds runs
  the prefill tile (`prefill_kernel.h`, `pkv_prefill`): each 64-token chunk decoded once for up to
  384 query vectors of a kv head, swept by 6-vector register tiles; sparse V and int8 scores keep the
  general kernel's prefill tiles (~96 query vectors per task, K decoded into a transposed tile).
  `AttentionParams.bf16_dots` (opt-in, approximate, bound in its docstring) runs the tile with bf16
  products (vdpbf16ps) on AVX-512 BF16 builds (`pkv_prefill_bf16`), and there also the decode
  scores over bf16 / fp8 E4M3 keys (`scores_bf16_t`: only q rounded); elsewhere it is exact.
- Decoding (AVX-512): a 2/3/4-bit code is moved into its own 32-bit lane by one byte permute
  (vpermb) and a variable shift, then becomes a value through vpermps used as a 16-entry table
  (sub-byte tables replicated, so upper bits need no mask); 8-bit E4M3 by moving its bits into
  an fp16 and converting (the 2^8 exponent offset folded into q, the output or the group scales),
  int8 by sign extension, other 8-bit tables by a gather; bf16 by a
  shift. Scalar unpacking (numba) and torch-level dequantisation were measured 3-15x slower than
  bf16 (issue 8's table), hence SIMD decode fused with the dot products.
- Memory latency, not bandwidth, was the second wall: blocks sit in random order, so hardware
  prefetchers do not help. 32k, batch 1, turbo3, ms/step: no software prefetch 145; whole next
  chunk prefetched at chunk start 70; K at start and V after the first head 65; one row of the
  next chunk per row processed (steady stream) 58; V accumulators as fixed-size register arrays
  instead of a variable-length array 52. Other steps (single layer, L3-resident, ms per layer):
  first version 3.6 -> no integer division in the scale lookup + prefetch 2.3 -> dot path
  instead of transposes for few queries 2.1 -> 64-token chunks and scales decoded per token for
  all heads 1.64 -> V in registers 1.56.
- The kernel is exact fp32 by default (|out - reference| ~1e-6); the AVX2 and AVX-512 builds
  have an opt-in integer score path (`AttentionParams.int8_scores`, below).

Measured ratios (ms / fastest torch way over a contiguous bf16 cache, which is always the plain
bf16 matmul -> softmax -> matmul with the group folded; `pagedkv bench attention`):

| format | 1k b1 | 4k b1 | 16k b1 | 32k b1 | 1k b8 | 4k b8 | 16k b8 | 32k b8 |
|---|---|---|---|---|---|---|---|---|
| bf16 | 0.71 | 0.68 | 0.75 | 0.72 | 0.77 | 0.72 | 0.78 | 0.84 |
| fp8 | 0.65 | 0.57 | 0.60 | 0.57 | 0.64 | 0.58 | 0.60 | 0.62 |
| turbo4 | 0.72 | 0.65 | 0.69 | 0.62 | 0.71 | 0.63 | 0.65 | 0.66 |
| turbo3 | 0.68 | 0.62 | 0.65 | 0.60 | 0.69 | 0.61 | 0.65 | 0.63 |
| turbo2 | 0.68 | 0.60 | 0.62 | 0.58 | 0.67 | 0.58 | 0.60 | 0.60 |
| fp8k_turbo3v | 0.66 | 0.60 | 0.59 | 0.60 | 0.64 | 0.59 | 0.56 | 0.57 |
| (baseline ms/step) | 3.9 | 11.5 | 38.9 | 78.3 | 20.6 | 81.3 | 318.2 | 625.9 |
| (turbo3 ms/step) | 2.6 | 7.2 | 25.4 | 47.0 | 14.2 | 49.4 | 205.4 | 391.5 |

The bar of issue 8 (turbo3 / turbo4 <= 1.0 at 16k and 32k) holds with margin (0.60-0.69); the
goal (<= 0.5) does not: the kernel is compute-bound (~3.5 GB/s of compressed bytes against a
measured 27-39 GB/s streaming read), its time going to decode, fp32 FMAs and the reduction.
E4M3 values were the slowest format until they were decoded through fp16 bits and vcvtph2ps
(exact): the earlier bit trick multiplied fp32 denormals (E4M3 subnormals) by 2^120, which costs
a microcode assist per multiply (fp8 at 32k: 79 -> 46 ms/step). Chunked prefill (512 queries
after 3.5k cached tokens) runs at 0.70-0.77 of torch SDPA over bf16. Peak memory of a 32k decode
step: no measurable growth of the resident set (the reference's gather-and-decode adds ~49 MB).

AVX2 path (issue 14; machines without AVX-512, such as this session's AMD EPYC Zen 3 VM: AVX2,
FMA, F16C, no AVX-512, no VNNI, 2 shared cores). Until then AVX2 machines ran the portable C
(decode into a tile, transpose, compiler-vectorised loops, scalar expf) at 2.4-3.0x the torch
baseline. The AVX2 build now mirrors the AVX-512 technique with 8-lane vectors: a 2/3/4-bit code
reaches its 32-bit lane by a broadcast of the word holding 8 codes and a variable shift, vpermps
is the 8-entry table (4-bit: two tables blended on bit 3), E4M3 via fp16 bits + vcvtph2ps, K
rows decoded into registers and dotted with the few query vectors of a decode (8-token hadd
reduction tree), V into MM x CG register accumulators (fixed-size arrays: the first version used
VLAs, which live on the stack), a vectorised exp, 4-queries x 16-tokens register tiles for
prefill. `pagedkv bench attention`, 1 thread, 32k, batch 1, ms/step portable -> AVX2 (ratio to
the fastest torch way): turbo3 517 -> 199 (2.41 -> 0.70), turbo4 591 -> 191 (2.75 -> 0.67),
fp8k_turbo3v 649 -> 169 (3.02 -> 0.60), measured at load averages 2-6 on the 2 cores (thread CPU
time; the baseline itself moved 210-284 ms with the load); batch 8: 0.57-0.74. Chunked prefill
(512 queries after 3.5k): 3.56 -> 1.40 of SDPA (fp32 FMA tiles; SDPA's GEMMs are more efficient
here). Still compute- or latency-bound: 0.8-1.6 GB/s of compressed bytes.
Later steps (issue 14, A/B of two builds in one process, thread CPU time, load 7-13): the prefill
V tile's accumulator array was kept on the stack by gcc (each FMA waited on a store-to-load round
trip): named register accumulators, 6 queries x 16 per pass for the score and V tiles and ~96
query vectors per task took prefill 512-after-3.5k from 1.35 to 0.87-1.00 of SDPA; group scales
of a block's tokens decoded in one vector pass: decode 0.90x the time. Integer scores
(`AttentionParams.int8_scores`, off by default; attention_i8.h): codes -> u8 levels by byte
shuffles, a power-of-two multiply and a table shuffle, vpmaddubsw/vpmaddwd against the int8
query, group scales by one FMA per 8 lanes: 0.87-0.90x the exact decode time for turbo3/turbo4
at 32k. Without VNNI the per-query cost per 32 dims (maddubs, maddwd, sub, convert, FMA) is not
below the 4 FMAs it replaces, so only the K decode gets cheaper; the prefill tiles stay fp32.

Where an AVX2 decode step's time goes (issue 14; turbo3, 32k, batch 1, 1 thread; `perf record -e
cpu-clock` (this VM has no hardware counters) over the bench's decode loop, share of the kernel's
samples): V accumulation 45%, K scores 40%, softmax + chunk loop 8.5%, scale decode 3.7%, row
pointers (fill_chunk) 3.2%. Ablation builds timed A/B in one process (load 5, medians): scores
skipped 0.72x, V skipped 0.73x, exp skipped 0.96x; the same work over block tables folded into 64
blocks (L2-resident, no DRAM) 0.79x, so ~1/5 is memory, the rest instructions: per 8 values the
3-bit decode took a scalar load, a shift, vmovd, vpbroadcastd, vpsrlvd, vpermps and a per-chunk
tail branch, and the V pass of 3 queries x 32 dims spilled accumulators (~300 instructions per
token and kv head, ~2.7 per cycle). Now a 2/3/4-bit code group is one 4-byte broadcast load
(vbroadcastss from memory), vpsrlvd, vpermps (the row's last group loaded 4 - bits bytes early,
its shift vector picked by index: no branch), a K row is decoded once per 64 dims into registers
and dotted with each query in two FMA chains, E4M3 values take unpack + shift + and (was 6 ops):
A/B in one process, main -> this, 32k b1, medians of 15: turbo3 0.80x, fp8k_turbo3v 0.81x the
time (load 4.3-5.5). After it: K 45%, V 39%, softmax + loop 9%. Then (A/B in one process, 32k b1,
load 3.8-4.1, 0.86-0.96x the time): the V pass for 3 query vectors no longer keeps an accumulator
on the stack (weights pre-broadcast as FMA memory operands), 2/3-bit tables take the group scale
once per 16 values, fully visible chunks skip the mask pass, row pointers are filled per block.
Pools on 2 MiB pages (`ops.hugepages.advise`) take 0.90x the time at 32k batch 8 (TLB misses).

AVX-512 on AMD EPYC Zen 5 (issue 14; AVX-512 F/BW/VL/VBMI/VBMI2, VNNI, BF16, a 2-core VM shared
with other jobs, load 2-5 during these measurements). The avx512 decode path predated the AVX2
work. Where a step's time went (turbo3, 32k b1, ablation builds A/B in one process, load 3.4):
K scores 43%, V 24%, the rest (softmax, scale decode, row pointers, the Python call) 33%; the
same work over block tables folded into 64 blocks (L2-resident) took the same time, so it is
instruction-bound, not memory-bound. Changes (A/B against the previous build in one process,
thread CPU time, 32k b1, medians):
- exact path (15cbe14): a 64-value pass's code bytes are loaded once and each 16-value chunk is a
  vpermb from that register (decode64; E4M3 by one masked vpermb into fp16 bits + shift + and,
  was 6 ops), the query count a compile-time constant in scores_dot, lut_ctx copied to a local
  (gcc reloaded its vectors after every partial-score store: vector types may alias), a block's
  group scales decoded 16 at a time, the mask pass skipped for fully visible chunks: turbo3
  0.81x, turbo4 0.77x, fp8k_turbo3v 0.87x the time (load 5.2);
- integer scores (10b21e5, `int8_scores`, same quantization and bound as AVX2): 64 codes -> 64
  u8 levels in three byte ops (vpermb, vpmultishiftqb, vpermb as a 64-entry table); 16 tokens'
  level rows transposed as dwords (tokens in lanes), so vpdpbusd against 4 query bytes
  broadcast accumulates each token's score in its own lane with no horizontal sums; per 16-dim
  group the accumulator starts at the offset correction and one FMA applies the 16 tokens'
  gathered scales. A first version kept dims in lanes (one vpdpbusd per query and 64 dims, then
  the 16-token shuffle tree): only 0.90x the exact time for turbo3, 1.0x for turbo4, since the
  reduction and partial stores, not the decode, dominated. Transposed: turbo3 int8 34.5 ms vs
  58.2 ms exact on the previous main (min of 21, load 3.9). Later (0ee0fec): the 16-lane gather
  of the group scales (per 16 tokens, 16-dim group and kv head: ~13% of scores_i8_t's samples)
  replaced by one aligned load from the chunk's K scales transposed once per chunk
  (i8_scales_t: a block's raw E4M3 scale bytes, up to 16 per token, through 3 byte permutes per
  4 outputs, no decode_scales for K; other layouts decoded and transposed 16 x 16 in registers):
  turbo3 0.89x / 0.86x, turbo4 0.91x / 0.95x the int8 time at 32k b1 / b8 (A/B of the two builds
  in one process, 41 repeats, load 1.2-1.5).
- exact scores over table keys with the integer path's layout (scores_lut_t in attention_i8.h;
  2/3/4-bit table keys with group scales, head_dim a multiple of 64, <= 4 query vectors per
  task): the 16 tokens' code bytes of a 64-dim pass (load, vpermb, vpmultishiftqb) transposed as
  dwords, then per dim one shift + vpermps (the 16-entry table) gives the 16 tokens' fp32 key
  values and one FMA per query adds them to 16 tokens' scores; per 16-dim group one FMA with the
  transposed scales. ~27 instructions per token and kv head for 3 queries against scores_dot_t's
  ~45 (decode64, 4 scale multiplies, partial vectors, the 16-token reduction tree). A/B in one
  process against the previous build (31 repeats, 32k, load 3-4 while CI ran): turbo3 0.84x /
  0.82x, turbo4 0.84x / 0.85x the exact decode time (b1 / b8).
- tried, did not pay: an integer P.V (`int8_values`, 9beecda, reverted by the next commit). Per
  (query, 64-token chunk) the weights p * group scale quantized to s8 (one step wmax / 127), the
  V levels as the score path's 7-bit images, vpdpbusd over 4 tokens x 4 dims per lane (a quad's
  code rows interleaved by vpermi2b + vpmultishiftqb + vpermb), the offset removed exactly; error
  bound sum_i (wsc / 2) ls |lev| + sum_i |w| |ls lev - level|, tested against a float64 oracle of
  the same arithmetic; on the bench's data 0.013 of the output RMS next to the codec's own 0.21
  (turbo3). The product loop is ~17 instructions per token and kv head against the exact V's ~39,
  but the weight preparation (scale transpose, quantization, offset sums) took a third of the
  path: A/B in one process against int8 scores with the exact V, 41 interleaved repeats, 32k, load
  0.3: turbo3 0.96x / 0.96x, turbo4 1.01x / 1.02x the time (b1 / b8 medians of per-repeat ratios;
  the fastest repeats 1.00-1.02x); 0.91-0.96x only at load 2.8-4.2. An approximation that buys no
  time on a quiet core is not offered.
`pagedkv bench attention --formats turbo3,turbo4,fp8k_turbo3v --contexts 32k --batch 1,8
--repeats 5 --int8-scores --no-memory --no-prefill`, 1 thread, load 3.5-3.7 (the baseline itself
moved 84-125 ms between runs): 32k b1 exact 0.56 / 0.54 / 0.50, int8 0.42 / 0.43 (fp8k_turbo3v:
E4M3 keys take no integer path); b8 exact 0.53 / 0.51 / 0.52, int8 0.42 / 0.43. Tried, did not
pay: the exact K's first two shuffle stages in registers per 4 tokens (12 accumulators live):
1.05-1.12x the time (register pressure); V accumulated in bf16 by vdpbf16ps (an approximate
setting, bound (2^-8 + 2^-17) max |v|_2, tested, then dropped): two tokens per instruction, the
pair's codes interleaved by vpermt2b and looked up by vpermw, weights p * scale as bf16 pairs
(gathered scales): 1.03-1.14x the time of the exact V; with the scale folded into a per-pair
32-entry bf16 table (vcvtne2ps2bf16) instead: 0.86-1.06x, no clear gain (min of 15: 41.9 vs
40.0 ms turbo4 int8), so V stays exact fp32 (~35 ops per token and kv head: decode, scale,
12 FMAs for 3 queries). bf16 decode scores (`bf16_dots`, bf16 / E4M3 keys without group scales:
fp8k_turbo3v's E4M3 keys have no integer path): vdpbf16ps with only q rounded (the keys are exact
in bf16), two tokens per vector (128-bit lanes [t0 d0-7 | t1 d0-7 | t0 d8-15 | t1 d8-15] by one
vpermi2b of the two rows, so one accumulator holds two tokens and a quad folds into 4 x 4 lanes:
1 partial store per 4 tokens, a 2-level reduction per 16), E4M3 -> bf16 by shift + ternlog with
the exponent rebiased (subnormals, exponent 0, from a masked vpermw table): ~26 ops per token and
kv head instead of ~40. A first version (one token per vector, E4M3 through fp16 -> fp32 ->
vcvtne2ps2bf16, the 16-token hsum tree) took 0.93x the exact time. In one process, interleaved
with the torch baseline (thread CPU time, medians of 7-11, load 0.8-1.9), 32k b1 exact -> bf16:
43.7 -> 34.3 ms (ratio 0.50 -> 0.39), 64.0 -> 53.9 (0.44 -> 0.37), 50.1 -> 43.5 (0.52 -> 0.45);
b8: 335 -> 278 ms (0.44 -> 0.36), 373 -> 288 (0.50 -> 0.39), 329 -> 264 (0.49 -> 0.39), i.e.
0.77-0.91x the exact time. `pagedkv bench attention ... --int8-scores --bf16-dots` (5 / 7
repeats, load 1.3-1.7): fp8k_turbo3v b1 0.53 -> 0.45 / 0.53 -> 0.44, b8 0.53 -> 0.46 /
0.55 -> 0.50 (the turbo3 / turbo4 bf16 rows compute exactly and moved 0.50-0.58 against their
fp32 rows' 0.50-0.57: the noise of this VM). Tried, did not pay (A/B of builds, 25 repeats): the
prefetches spread over the quad's two pairs, one line per 64-byte row, no scale prefetch: 0.98x
(min equal). Two threads (batch 1, 32k): the kernel splits a sequence into 2 x
threads block ranges (dynamic schedule, log-sum-exp merge); in one process, 21 repeats with the
three formats and both thread counts interleaved (load 2.3), exact, ms per step 1 -> 2 threads
(medians): turbo3 41.9 -> 22.8 (1.83x), turbo4 42.7 -> 22.9 (1.86x), fp8k_turbo3v 39.7 -> 22.4
(1.78x; fastest repeats 1.87-1.90x); 8 / 16 / 32 splits instead of 4: 22.5 / 22.9 / 24.5 ms vs
22.0 (turbo3, fastest of 21), so the split count stays. Chunks of 128 or 256 tokens instead of
64: 0.97-1.0x the time (fastest of 25), within the noise, so they stay at 64. The per-call serial part (Python,
setup) is ~50 us of ~1.4 ms per layer. The bench's wall-clock medians swung 0.7-1.8x between
runs at load 1.6-2.7 on this VM: two copies of a pure-compute loop ran at 1.9x the throughput of
one when the machine was quiet and at 0.9-1.3x when other jobs were active.

Sparse V (threshold t > 0): a V row is skipped when exp(s - m_run) < t * Z_run for every query of
the tile, where m_run / Z_run are the running max / denominator (sinks included). Since the final
weight is at most exp(s - m_run) / Z_run, only positions whose final weight is < t are skipped;
some positions below t may still be read (the reference skips all of them; docs/internals.md).

Cache write (`store`, `write.py` + `store_kernel.c`, compiled into the same library): per side,
one C call encodes the rows (rotated first in torch, exactly as the reference does, for rotated
codecs), packs the codes and writes them straight into the pool blocks at their slots; bytes
equal the reference store's (the E4M3 scale search of the table codecs sums each candidate's
error in torch's order, so even exact ties resolve alike). The reference encoder built ~100
short-lived temporaries per call (10 scale candidates x a few full-size tensors) and ran at 7-18 M
elements/s for the table codecs; the C store allocates nothing but the rotated copy (after 200
chunk stores glibc holds 0.5-1.4 MB of free heap against the reference's 1-6 MB; in a whole
model run the free-but-held heap comes mostly from elsewhere: `bench_store.py --model-memory`). Measured (`benchmarks/perf/bench_store.py`, 1 thread, one 256-token SmolLM2 chunk,
K and V, M elements/s reference -> C, medians of 9): turbo3 10 -> 134, turbo4 7 -> 116, turbo2
13 -> 152, nvfp4 9 -> 164, turbo8 145 -> 388, q8_0 230 -> 841, q4_0 127 -> 347, fp8 274 -> 2025,
bf16 265 -> 1953; a one-token (decode) call of turbo3 1474 -> 25 us. SmolLM2 end to end (1024-
token prefill in 256-token chunks, 1 thread): turbo3 prefill 9.1 -> 5.8 s (time in the store
2.06 -> 0.14 s), decode 189 -> 75 ms/token (store 87 -> 2.3 ms/token). For turbo3 the C scale
search (10 exact divisions per element) is ~3/4 of the store time, the torch WHT matmul ~1/5.

Public helpers: `available()`, `kernel_info()`, `attention(...)` (explicit thread count and
stats), and the backend ops `store` / `decode_attention` / `prefill_attention` (reference
signatures).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from ..batch import AttentionParams, PagedLayer
from ..dispatch import Backend, Op, register_backend
from . import write as _store
from .attention import _Args, _Side, run_attention
from .build import KernelConfig, KernelUnavailable, LoadedKernel, build_and_load

log = logging.getLogger(__name__)

_kernel: Optional[LoadedKernel] = None
_error: Optional[str] = None


def load(config: KernelConfig = KernelConfig()) -> LoadedKernel:
    """Build (if needed) and load the kernel with `config`; raises KernelUnavailable."""
    global _kernel, _error
    k = build_and_load(config)
    k.lib.pkv_attention.restype = ctypes.c_int
    k.lib.pkv_attention.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Side), ctypes.POINTER(_Side)]
    k.lib.pkv_stream_sum.restype = ctypes.c_double
    k.lib.pkv_stream_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    k.lib.pkv_store.restype = ctypes.c_int
    k.lib.pkv_store.argtypes = [ctypes.POINTER(_store._StoreArgs)]
    _kernel, _error = k, None
    return k


def available() -> bool:
    """True when the compiled kernel is loaded."""
    return _kernel is not None


def kernel_info() -> dict:
    """How the kernel was built: variant, OpenMP, compiler, library path (or the load error)."""
    if _kernel is None:
        return {"available": False, "error": _error}
    return {"available": True, "variant": _kernel.variant, "openmp": _kernel.openmp,
            "compiler": _kernel.compiler, "path": _kernel.path}


def _require() -> LoadedKernel:
    if _kernel is None:
        raise KernelUnavailable(f"the CPU attention kernel is not available: {_error}")
    return _kernel


def attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              query_start_loc: torch.Tensor, params: AttentionParams, *,
              num_threads: Optional[int] = None, stats: Optional[dict] = None,
              lse: Optional[torch.Tensor] = None, key_start: int = 0) -> torch.Tensor:
    """Packed-query attention (decode when every sequence has one query); see `run_attention`.

    Inputs are trusted (block ids, lengths and table widths are not re-checked here): call it with
    inputs that `pagedkv.ops.validate` accepts, or use the public ops with backend="cpu"."""
    return run_attention(_require(), q, layer, block_tables, seq_lens, query_start_loc, params,
                         num_threads=num_threads, stats=stats, lse=lse, key_start=key_start)


def stream_read_gbps(nbytes: int = 1 << 29, threads: int = 1, repeats: int = 5) -> float:
    """Measured streaming-read bandwidth (GB/s, 1e9 bytes): best of `repeats` sums of a fresh
    float32 buffer of `nbytes` (larger than the caches, so the reads come from DRAM)."""
    import time

    lib = _require().lib
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        lib.pkv_stream_sum(buf.data_ptr(), buf.numel(), int(threads))
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def decode_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """q float [B, Hq, D] -> [B, Hq, D] (reference signature; query at position seq_lens[b]-1)."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return attention(q, layer, block_tables, seq_lens, qsl, params)


def prefill_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      params: AttentionParams) -> torch.Tensor:
    """q float [Tq, Hq, D] packed varlen -> [Tq, Hq, D] (reference signature, bottom-right causal)."""
    return attention(q, layer, block_tables, seq_lens, query_start_loc, params)


def store(layer: PagedLayer, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
          slot_mapping: torch.Tensor) -> None:
    """Write new K/V rows into the pools (reference signature and bytes; see `write.py`)."""
    _store.store(_require().lib, layer, k, v, slot_mapping)


def supports(op: Op, layer: PagedLayer, params: Optional[AttentionParams]) -> bool:
    """Attention: CPU tensors with head_dim a multiple of 16 and byte-contiguous pools. Store:
    every case (the C store hands a side it does not cover to the reference store)."""
    if op is Op.STORE:
        return True
    return (_kernel is not None and layer.device.type == "cpu" and layer.head_dim % 16 == 0
            and layer.k_pool.stride(1) == 1 and layer.v_pool.stride(1) == 1)


try:
    load()
except KernelUnavailable as exc:
    _error = str(exc)
    log.warning("pagedkv: fast CPU attention unavailable (%s); using the reference ops", exc)

if _kernel is not None:
    BACKEND = Backend(name="cpu", device_types=("cpu",), store=store,
                      decode_attention=decode_attention, prefill_attention=prefill_attention,
                      supports=supports, priority=10)
    register_backend(BACKEND)
