"""Attention ops on the paged, compressed cache.

Public ops validate their inputs then dispatch by device (`dispatch.py`); `reference/` is the
readable oracle with the same signatures; `fused.py` is the RMSNorm -> RoPE -> store K path.
"""

from .api import decode_attention, prefill_attention, store
from ..approx import Approximation
from .batch import AttentionParams, PagedLayer, make_layer
from .dispatch import Backend, Op, backends, get_backend, register_backend, select_backend
from .fused import NormSpec, RopeSpec, norm_rope, store_k_fused, store_v

__all__ = [
    "store", "decode_attention", "prefill_attention",
    "AttentionParams", "Approximation", "PagedLayer", "make_layer",
    "Backend", "Op", "backends", "get_backend", "register_backend", "select_backend",
    "NormSpec", "RopeSpec", "norm_rope", "store_k_fused", "store_v",
]
