"""Triton fused K path: per-head RMSNorm -> RoPE -> encode + scatter, in one kernel.

Semantics are `pagedkv.ops.fused.store_k_fused` (fp32 in between, rounding only when the codec
encodes): the store kernel runs with its NORM / ROPE prologue, which also writes the fp32 keys
it stored (before k_centre) so the caller can reuse them. RoPE angles come from
`pagedkv.ops.fused.rope_angles` on the host (cos / sin [T, rotary_dim / 2], any RoPE variant,
multimodal included); the kernel applies the neox half split. The WHT of rotated codecs stays in
the kernel, so this path needs head_dim <= 128 for them (larger head dims fall back to
normalising in torch and the plain Triton store). A layer with `k_mult` takes that fallback too
(the multiplier sits between RoPE and the centre, which the kernel's prologue does not do).

Known deviation: 1/sqrt and the mean of squares are computed in a different order than torch's
rsqrt / mean, so the fp32 keys can differ from the reference in the last bit; the stored bytes
are those the reference encoder gives for the keys this kernel returns.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import transform
from ..batch import PagedLayer
from ..fused import NormSpec, RopeSpec, norm_rope, rope_angles
from .store import ROTATE_IN_KERNEL_MAX_D, store_side


def store_k_fused(layer: PagedLayer, k: torch.Tensor, slot_mapping: torch.Tensor,
                  positions: Optional[torch.Tensor], *, norm: Optional[NormSpec] = None,
                  rope: Optional[RopeSpec] = None) -> torch.Tensor:
    """Normalise, rotate and store raw keys; returns the fp32 keys stored (before k_mult / k_centre).

    k: float [T, num_kv_heads, head_dim]; slot_mapping: int64 [T] (negative = skip);
    positions: int [T] ([3, T] for multimodal RoPE; unused without rope). Inputs validated by
    `pagedkv.ops.fused.store_k_fused`'s checks.
    """
    t, h, d = k.shape
    if ((norm is None and rope is None) or layer.k_mult is not None
            or (layer.k_codec.rotated and d > ROTATE_IN_KERNEL_MAX_D)):
        kf = norm_rope(k, positions, norm, rope)
        store_side(layer, layer.k_codec, layer.k_pool, layer.k_scale, transform.keys_to_store(layer, kf),
                   slot_mapping, layer.k_centre)
        return kf
    kf = torch.empty(t, h, d, dtype=torch.float32, device=k.device)
    if t == 0:
        return kf
    dummy = kf
    prologue = dict(kf_ptr=kf, NORM=norm is not None, ROPE=rope is not None)
    if norm is not None:
        w = norm.weight.to(k.device, torch.float32)
        prologue.update(w_ptr=(1.0 + w if norm.unit_offset else w).contiguous(), eps=float(norm.eps))
    else:
        prologue.update(w_ptr=dummy)
    if rope is not None:
        rd = rope.dim(d)
        angles = rope_angles(rope, positions, d)  # [T, rd / 2]
        prologue.update(cos_ptr=(angles.cos() * rope.attention_scaling).contiguous(),
                        sin_ptr=(angles.sin() * rope.attention_scaling).contiguous(), RD=rd)
    else:
        prologue.update(cos_ptr=dummy, sin_ptr=dummy)
    if k.stride(-1) != 1:
        k = k.contiguous()
    store_side(layer, layer.k_codec, layer.k_pool, layer.k_scale, k, slot_mapping, layer.k_centre,
               prologue=prologue)
    return kf
