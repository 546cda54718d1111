"""GPU ops in Triton: store, paged decode (split-K) and chunked prefill on the compressed cache.

One kernel source per op, generic over the (K codec, V codec) pair through compile-time
constants derived from the catalogue rows (`spec.py`). Importing this module registers the
"triton" backend for CUDA tensors with `pagedkv.ops.dispatch` (the dispatcher imports it lazily
on the first op on a CUDA tensor). Without Triton the import fails with an ImportError saying
`pip install triton`; the dispatcher logs it and falls back to the reference ops.

`store_k_fused` is the fused RMSNorm -> RoPE -> store K kernel (semantics of
`pagedkv.ops.fused.store_k_fused`).

On a machine without a GPU the kernels still run on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, which must be set before Triton is first imported; tests set it):
`interpreter_backend()` returns an unregistered Backend for such tensors, to pass as
`backend=` to the public ops.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv's GPU kernels need Triton, which is not installed: pip install triton "
        "(or pip install 'pagedkv[test]'); until then CUDA tensors use the reference ops"
    ) from exc

from ..batch import AttentionParams, PagedLayer
from ..dispatch import Backend, Op, register_backend
from .decode import decode_attention
from .fused import store_k_fused
from .prefill import prefill_attention
from .spec import SUPPORT, supports_head_dim
from .store import store


def supports(op: Op, layer: PagedLayer, params: AttentionParams | None) -> bool:
    """head_dim a multiple of 16 up to 256; pools with contiguous rows (which codecs: `SUPPORT`,
    enforced by the dispatcher)."""
    return (supports_head_dim(layer.head_dim) and layer.k_pool.stride(1) == 1
            and layer.v_pool.stride(1) == 1)


def interpreting() -> bool:
    """True when these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 was
    set when this package was imported; Triton decides at decoration time)."""
    from .decode import _decode_kernel

    return type(_decode_kernel).__name__ == "InterpretedFunction"


def make_backend(precision: str = "fp32", *, name: str = "triton", priority: int = 100,
                 device_types: tuple = ("cuda",)) -> Backend:
    """A Backend running these kernels with the given matmul operand precision.

    precision: "fp32" (fp32-accurate products: exact FMAs in decode, 3xTF32 tensor-core
    products in prefill; matches the reference to fp32 rounding), "tf32" or "bf16" (operands
    rounded, tensor cores, as SDPA and FlashAttention do over a bf16 cache; the registered
    default); fp32 accumulation either way. Register one to make it the CUDA default:
    `register_backend(make_backend("fp32"))` (same name: replaces the default one).
    """
    from functools import partial

    from .decode import check_precision

    check_precision(precision)
    return Backend(
        name=name,
        device_types=device_types,
        store=store,
        decode_attention=partial(decode_attention, precision=precision),
        prefill_attention=partial(prefill_attention, precision=precision),
        supports=supports,
        priority=priority,
        store_k_fused=store_k_fused,
        codecs=SUPPORT,
    )


# bf16 operands by default: on an H200 it computed the same attention as "fp32" to three digits
# of the error against SDPA, for every format, at a fraction of the time (docs/gpu.md)
BACKEND = make_backend("bf16")
register_backend(BACKEND)


def interpreter_backend() -> Backend:
    """The Triton ops as an unregistered backend that accepts CPU tensors (interpreter only)."""
    if not interpreting():
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                           "pagedkv.ops.triton is first imported")
    return make_backend(name="triton-interpreter", device_types=("cpu",), priority=0)


__all__ = ["store", "decode_attention", "prefill_attention", "store_k_fused", "BACKEND", "make_backend", "supports",
           "interpreter_backend", "interpreting"]
