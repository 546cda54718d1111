"""Fast CPU attention on the compressed paged cache: a fused C kernel, compiled at first use.

Importing this module compiles (once, cached on disk, see `build.py`) and loads the kernel, then
registers the "cpu" backend with the ops dispatcher. Without a C compiler the import logs a
warning and registers nothing, so the dispatcher uses the reference ops.

Technique (chosen by measurement; numbers from `pagedkv bench attention`, this machine: AMD EPYC
with AVX-512, 1 thread, 30 layers x (9 q heads, 3 kv heads, head_dim 64), see the README table):
- The kernel walks each sequence's blocks once (flash-decoding style, online softmax, fp32
  accumulation), never building a full-precision copy of the context: per block it decodes the K
  rows of one kv head into a 16-token fp32 tile in L1, transposes it, and computes the scores of
  every query vector sharing that kv head (the GQA group, times the query rows of a prefill tile)
  with broadcast FMAs; then it decodes the V rows still needed and accumulates p * v.
- Decoding (AVX-512): a code of 2, 3 or 4 bits is moved into its own 32-bit lane by one byte
  permute (vpermb) and a variable shift, then turned into a value by vpermps used as a 16-entry
  table (sub-byte tables replicated so the upper bits need no mask); 8-bit E4M3 by bit arithmetic,
  int8 by sign extension, other 8-bit tables by a gather; bf16 by a shift. Group scales multiply
  each 16-lane vector. Scalar unpacking (numba) and torch-level dequantisation were measured 3-15x
  slower than bf16 (issue 8's table), which is why the decode is SIMD and fused with the dot.
- Decode parallelises over (sequence, block range) with all kv heads of a block in one task (the
  rows of the kv heads share cache lines); partial softmax states of block ranges are merged.
  Prefill tiles ~64 query vectors per kv head so each decoded block serves them all.
- Sparse V (threshold t > 0): a V row is skipped when exp(s - m_run) < t * Z_run for every query
  of the tile, where m_run / Z_run are the running max / denominator (sinks included). Since the
  final weight is at most exp(s - m_run) / Z_run, only positions whose final weight is < t are
  skipped; some positions below t may still be read (the reference skips all of them).

Public helpers: `available()`, `kernel_info()`, `attention(...)` (explicit thread count and
stats), and the backend ops `decode_attention` / `prefill_attention` (reference signatures).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from ..batch import AttentionParams, PagedLayer
from ..dispatch import Backend, Op, register_backend
from ..reference import store as _reference_store
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
              num_threads: Optional[int] = None, stats: Optional[dict] = None) -> torch.Tensor:
    """Packed-query attention (decode when every sequence has one query); see `run_attention`."""
    return run_attention(_require(), q, layer, block_tables, seq_lens, query_start_loc, params,
                         num_threads=num_threads, stats=stats)


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


def supports(op: Op, layer: PagedLayer, params: Optional[AttentionParams]) -> bool:
    """The kernel runs CPU tensors with head_dim a multiple of 16 and byte-contiguous pools."""
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
    BACKEND = Backend(name="cpu", device_types=("cpu",), store=_reference_store,
                      decode_attention=decode_attention, prefill_attention=prefill_attention,
                      supports=supports, priority=10)
    register_backend(BACKEND)
