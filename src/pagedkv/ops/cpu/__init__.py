"""Fast CPU attention on the compressed paged cache: a fused C kernel, compiled at first use.

Importing this module compiles (once, cached on disk, see `build.py`) and loads the kernel, then
registers the "cpu" backend with the ops dispatcher. Without a C compiler the import logs a
warning and registers nothing, so the dispatcher uses the reference ops.

How the kernel works (each choice was measured against its alternatives; the numbers, machines
and commands are in docs/performance.md, "Kernel design log"; re-measure with `pagedkv bench
attention` and an A/B of two builds in one process before changing one):
- Decode walks each sequence's blocks once (flash-decoding style, online softmax, fp32
  accumulation, GQA group folded: every query vector of a kv head shares each decoded K/V row),
  never building a full-precision copy of the context, in ~64-token chunks (several blocks; 128
  or 256 measured no faster): the chunk's scales are decoded once for all kv heads, then per kv
  head the K rows are decoded into registers and dotted with each query, the softmax state is
  updated, and the V rows still needed are decoded into register accumulators (fixed-size arrays:
  variable-length arrays and gcc's stack-kept accumulators each cost a store-to-load round trip
  per FMA).
- Decoding (AVX-512): a 2/3/4/5-bit code reaches its own 32-bit lane by one byte permute
  (vpermb) and a variable shift, then becomes a value through vpermps used as a 16-entry table
  (sub-byte tables replicated, so upper bits need no mask; 5-bit codes: vpermt2ps over 32
  entries); E4M3 by moving its bits into an fp16 and converting (the 2^8 exponent offset folded
  into q, the output or the group scales; never by multiplying fp32 denormals, which costs a
  microcode assist per multiply); int8 by sign extension, other 8-bit tables by a gather, bf16
  by a shift. AVX2 mirrors this with 8 lanes (a 4-byte broadcast load + vpsrlvd + vpermps per
  code group, 4-bit as two tables blended on bit 3; 5-bit: an 8-byte broadcast and a byte
  shuffle first, four tables blended on bits 3 and 4).
  Scalar unpacking and torch-level dequantisation are several times slower: hence SIMD decode
  fused with the dot products.
- Exact scores over 2/3/4/5-bit table keys with group scales (AVX-512, head_dim a multiple of 64,
  <= 4 query vectors, `scores_lut_t` in attention_i8.h) use the integer path's tokens-in-lanes
  layout: 16 tokens' code bytes transposed as dwords, one shift + vpermps per dim, one FMA per
  query, no reduction tree.
- Blocks sit in random order, so hardware prefetchers do not help: the kernel prefetches one row
  of the next chunk per row it processes (a steady stream). It is instruction-bound, not
  memory-bound (L2-resident block tables run no faster).
- Prefill on AVX2 and AVX-512 builds runs the prefill tile (`prefill_kernel.h`, `pkv_prefill`):
  each 64-token chunk decoded once for up to 384 query vectors of a kv head, swept by 6-vector
  register tiles (online softmax per micro-block, chunks a micro-block cannot see skipped, only
  partly visible chunks masked); sparse V and int8 scores keep the general kernel's prefill tiles
  (~96 query vectors per task, K decoded into a transposed tile).
- Exact fp32 by default (|out - reference| ~1e-6). Opt-in approximations, each with a derived
  bound tested for every codec pair it takes: `AttentionParams.int8_scores` (2/3/4/5-bit table keys
  as 7-bit levels against an int8 query: vpdpbusd with 16 tokens' scores in 16 lanes on VNNI,
  vpmaddubsw + vpmaddwd on AVX2, the K group scales transposed once per chunk) and
  `AttentionParams.bf16_dots` (AVX-512 BF16: the prefill tile's products, and decode scores over
  bf16 / E4M3 keys with only q rounded, two tokens per vector, `scores_bf16_t`).
- Tried and not kept (no gain on a quiet core): an integer P.V (`int8_values`), V accumulated in
  bf16, an integer prefill score tile without VNNI, the exact K's shuffle stages kept in registers
  (register pressure), more than 2 x threads context splits.
- Threads: at batch 1 a sequence's context is split into 2 x threads block ranges (dynamic
  schedule) merged by log-sum-exp; larger batches run sequences in parallel.

Sparse V (threshold t > 0): a V row is skipped when exp(s - m_run) < t * Z_run for every query of
the tile, where m_run / Z_run are the running max / denominator (sinks included). Since the final
weight is at most exp(s - m_run) / Z_run, only positions whose final weight is < t are skipped;
some positions below t may still be read (the reference skips all of them; docs/internals.md).

Cache write (`store`, `write.py` + `store_kernel.c`, compiled into the same library): per side,
one C call encodes the rows (rotated first in torch, exactly as the reference does, for rotated
codecs), packs the codes and writes them straight into the pool blocks at their slots; bytes
equal the reference store's (the E4M3 scale search of the table codecs sums each candidate's
error in torch's order, so even exact ties resolve alike). It allocates nothing but the rotated
copy (the reference encoder built ~100 short-lived temporaries per call); for turbo3 the scale
search (10 exact divisions per element) is most of its time, the torch WHT matmul the rest.

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
from ..support import CodecSupport
from . import write as _store
from .attention import ATTENTION_SUPPORT, _Args, _Side, run_attention
from .build import KernelConfig, KernelUnavailable, LoadedKernel, build_and_load

log = logging.getLogger(__name__)

_kernel: Optional[LoadedKernel] = None
_error: Optional[str] = None


def load(config: KernelConfig = KernelConfig()) -> LoadedKernel:
    """Build (if needed) and load the kernel with `config`; raises KernelUnavailable."""
    global _kernel, _error
    k = build_and_load(config)
    bind(k.lib)
    _kernel, _error = k, None
    return k


def bind(lib: ctypes.CDLL) -> None:
    """Declare the kernel library's entry points' argument and result types."""
    lib.pkv_attention.restype = ctypes.c_int
    lib.pkv_attention.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Side), ctypes.POINTER(_Side)]
    lib.pkv_stream_sum.restype = ctypes.c_double
    lib.pkv_stream_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32]
    lib.pkv_store.restype = ctypes.c_int
    lib.pkv_store.argtypes = [ctypes.POINTER(_store._StoreArgs)]


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
    every case `SUPPORT` declares (the C store hands a call it cannot run to the reference store,
    logged)."""
    if op is Op.STORE:
        return True
    return (_kernel is not None and layer.device.type == "cpu" and layer.head_dim % 16 == 0
            and layer.k_pool.stride(1) == 1 and layer.v_pool.stride(1) == 1)


try:
    load()
except KernelUnavailable as exc:
    _error = str(exc)
    log.warning("pagedkv: fast CPU attention unavailable (%s); using the reference ops", exc)

# What the backend implements: the attention kernel's rows and the C store's (every catalogue row)
SUPPORT = CodecSupport(decode=ATTENTION_SUPPORT.decode, groups=ATTENTION_SUPPORT.groups,
                      encode=_store.STORE_SUPPORT.encode, store_groups=_store.STORE_SUPPORT.groups)

if _kernel is not None:
    BACKEND = Backend(name="cpu", device_types=("cpu",), store=store,
                      decode_attention=decode_attention, prefill_attention=prefill_attention,
                      supports=supports, priority=10, codecs=SUPPORT)
    register_backend(BACKEND)
