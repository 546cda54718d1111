"""The public ops: validate the inputs, pick a backend (see dispatch.py), run it.

Every op takes two keyword-only settings:
- backend: None (automatic: the best registered backend for the inputs' device that supports the
  case, else the reference), a registered name ("reference", "cpu", "triton"), or a Backend;
- checks: True runs the value checks (NaN/Inf, slot / block-id / length ranges), which sync a GPU;
  shape, dtype and device checks always run.
They are inference ops: they run without autograd (no gradient flows through a compressed
cache), so they work the same inside and outside `torch.no_grad()`.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference  # noqa: F401  (registers the reference backend)
from . import validate
from .batch import AttentionParams, PagedLayer
from .dispatch import BackendChoice, Op, select_backend


@torch.no_grad()
def store(layer: PagedLayer, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
          slot_mapping: torch.Tensor, *, backend: BackendChoice = None, checks: bool = True) -> None:
    """Encode new keys/values into the layer's pools at their slots.

    k, v: float32/float16/bfloat16 [T, num_kv_heads, head_dim] (None stores only the other side);
    slot_mapping: int64 [T], slot = block_id * block_size + offset, negative = skip.
    Raises InvalidInput (naming the argument) before any write.
    """
    every = validate.check_store(layer, k, v, slot_mapping, checks)
    if not checks and layer.device.type == "cpu":
        # The CPU encoders reject NaN/Inf while writing: scanned first (one cheap pass, no device
        # sync on CPU) so that a store stays all-or-nothing with checks off too.
        validate.check_store_finite(k, v, slot_mapping, every)
    impl = select_backend(Op.STORE, layer.device, layer, None, backend)
    impl.store(layer, k, v, slot_mapping)


@torch.no_grad()
def decode_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, params: AttentionParams, *,
                     backend: BackendChoice = None, checks: bool = True) -> torch.Tensor:
    """Attention of one query token per sequence over its paged, compressed context.

    q: float [B, Hq, D] (Hq a multiple of num_kv_heads); block_tables: int32 [B, max_blocks];
    seq_lens: int32 [B] (tokens in the cache including the current one, 0 = padding row).
    Returns [B, Hq, D] in q's dtype. Semantics: `pagedkv.ops.reference.attention`.
    """
    validate.check_decode(q, layer, block_tables, seq_lens, params, checks)
    impl = select_backend(Op.DECODE, layer.device, layer, params, backend)
    return impl.decode_attention(q, layer, block_tables, seq_lens, params)


@torch.no_grad()
def prefill_attention(q: torch.Tensor, layer: PagedLayer, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      params: AttentionParams, *, backend: BackendChoice = None,
                      checks: bool = True) -> torch.Tensor:
    """Attention of packed varlen queries, causal and bottom-right aligned (chunked prefill).

    q: float [Tq, Hq, D]; query_start_loc: int32 [B+1]; seq_lens: int32 [B] including the new
    tokens (stored before the call); query j of sequence b sits at seq_lens[b] - q_len_b + j.
    Returns [Tq, Hq, D] in q's dtype.
    """
    validate.check_prefill(q, layer, block_tables, seq_lens, query_start_loc, params, checks)
    impl = select_backend(Op.PREFILL, layer.device, layer, params, backend)
    return impl.prefill_attention(q, layer, block_tables, seq_lens, query_start_loc, params)
