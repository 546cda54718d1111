"""The frozen descriptions attention ops consume: one layer's pools and the attention settings.

They live in ops/ (not cache/) so that ops never import the cache; the cache builds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..codecs.catalogue import Codec


@dataclass(frozen=True, eq=False)
class PagedLayer:
    """One layer's paged storage.

    k_pool, v_pool: uint8 [num_blocks, k/v block bytes] (data section then scale section).
    k_scale, v_scale: float32 [1]; the fp8 per-layer tensor scale (1.0 for other codecs).

    The per-layer transform (all optional float32 [num_kv_heads, head_dim], None = identity),
    applied by every backend's store and attention so callers never transform around the ops:
    - k_mult: stored keys are `k * k_mult - k_centre`; attention divides q by k_mult (per kv
      head, broadcast over its GQA group), so q . k is unchanged;
    - k_centre: in the multiplied space (as `cache.calibration.Calibration` defines it);
      attention adds (q / k_mult) . k_centre back to every logit, so results stay exact with
      soft-cap and sinks;
    - v_centre: stored values are `v - v_centre`; attention adds v_centre times the sum of the
      token weights (one minus the sinks' weight; before any sparse-V drop) to the output.
    """

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    k_codec: Codec
    v_codec: Codec
    block_size: int
    num_kv_heads: int
    head_dim: int
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    k_centre: Optional[torch.Tensor] = None
    k_mult: Optional[torch.Tensor] = None
    v_centre: Optional[torch.Tensor] = None

    @property
    def has_transform(self) -> bool:
        """True when any of k_mult / k_centre / v_centre is set."""
        return self.k_mult is not None or self.k_centre is not None or self.v_centre is not None

    @property
    def num_blocks(self) -> int:
        return int(self.k_pool.shape[0])

    @property
    def device(self) -> torch.device:
        return self.k_pool.device


@dataclass(frozen=True)
class AttentionParams:
    """Settings of one attention call.

    sliding_window: None or W; the query at position p sees keys at positions p - W < j <= p.
    soft_cap: None or c; logits become c * tanh(s / c).
    sinks: None or float32 [num_q_heads]; one learned logit per head joining the softmax
    denominator (it takes weight but contributes no value).
    sparse_v_threshold: 0.0 is exact; when > 0, positions whose softmax weight is below it skip
    the V read.
    int8_scores: False is exact; True permits a backend an approximate q.k in integers (the CPU
    kernel's AVX2 and AVX-512 decode paths for 2/3/4/5-bit table codes with group scales: the query quantized
    to int8 per vector, levels to 7 bits; the score error bound is in ops/cpu/attention_i8.h).
    Backends without such a path compute exactly.
    bf16_dots: False is exact; True permits a backend bf16 products (u = 2^-8: the relative
    rounding of bf16, round to nearest even, 8 significant bits). Two paths of the CPU kernel, on
    AVX-512 BF16 builds (elsewhere, and for other keys, it computes exactly):
    - prefill tile: q and K rounded to bf16 for the scores, softmax weights and V for the values,
      fp32 sums. Per query row, with e = (2u + u^2 + D 2^-24) scale max_j sum_d |q_d k_jd| (the
      score error bound, in the basis the keys are stored in): ||out - exact||_2 <=
      ((exp(2e) - 1) + (2u + u^2) exp(2e)) max_j ||v_j||_2 (tests/test_cpu_prefill.py);
    - decode scores (tasks of at most 8 query vectors) over bf16 or fp8 E4M3 keys without group
      scales, whose values are exact in bf16: only q is rounded, products are exact, sums fp32, so
      each score moves by at most e_j = (u + D 2^-24) scale sum_d |q_d k_jd| (+ 2^-126 per
      denormal input or sum, which vdpbf16ps flushes), each softmax weight by a factor within
      exp(+-2 max_j e_j), and ||out - exact||_2 <= (exp(2 max_j e_j) - 1) max_j ||v_j||_2
      (tests/test_cpu_bf16_decode.py). On Zen 5 it takes fp8k_turbo3v decode at 32k to ~0.8x
      the exact time (ops/cpu docstring).
    """

    scale: float
    sliding_window: Optional[int] = None
    soft_cap: Optional[float] = None
    sinks: Optional[torch.Tensor] = None
    sparse_v_threshold: float = 0.0
    int8_scores: bool = False
    bf16_dots: bool = False


def make_layer(k_codec: Codec, v_codec: Codec, num_blocks: int, block_size: int,
               num_kv_heads: int, head_dim: int, *, k_scale: float = 1.0, v_scale: float = 1.0,
               k_centre: Optional[torch.Tensor] = None, k_mult: Optional[torch.Tensor] = None,
               v_centre: Optional[torch.Tensor] = None,
               device: torch.device | str = "cpu") -> PagedLayer:
    """A PagedLayer with zeroed pools sized from the codecs (tests, benchmarks, simple callers).

    Pools: uint8 [num_blocks, codec.block_bytes(block_size, num_kv_heads, head_dim)] per side.
    k_centre / k_mult / v_centre: the per-layer transform (see PagedLayer), float [H, D] or None.
    Raises ConfigError if a codec cannot store `head_dim`.
    """
    from ..errors import ConfigError

    for name, value in (("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    k_bytes = k_codec.block_bytes(block_size, num_kv_heads, head_dim)
    v_bytes = v_codec.block_bytes(block_size, num_kv_heads, head_dim)
    return PagedLayer(
        k_pool=torch.zeros(num_blocks, k_bytes, dtype=torch.uint8, device=device),
        v_pool=torch.zeros(num_blocks, v_bytes, dtype=torch.uint8, device=device),
        k_codec=k_codec,
        v_codec=v_codec,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        k_scale=torch.tensor([float(k_scale)], dtype=torch.float32, device=device),
        v_scale=torch.tensor([float(v_scale)], dtype=torch.float32, device=device),
        k_centre=_f32(k_centre, device),
        k_mult=_f32(k_mult, device),
        v_centre=_f32(v_centre, device),
    )


def _f32(x: Optional[torch.Tensor], device) -> Optional[torch.Tensor]:
    return None if x is None else x.to(device, torch.float32).contiguous()
