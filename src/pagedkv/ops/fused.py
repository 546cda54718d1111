"""The fused K path: per-head RMSNorm -> RoPE -> store, fp32 in between, rounding only at the store.

qk-norm models (Qwen3, Gemma 3, OLMo 2 style) normalise each head's key vector, then apply RoPE,
then the key is cached. Doing the three in fp32 and rounding once, when the codec encodes,
avoids the two intermediate bf16 roundings of an unfused bf16 model. The same `norm_rope`
prepares q (never stored), so q and k see identical arithmetic. `store_v` is the V-only store
that goes with it.

RoPE here is the "neox" half split of HF Llama (`rotate_half`): within the first `rotary_dim`
elements, element i pairs with i + rotary_dim/2 (pair i, angle position * inv_freq[i]); the
remaining head_dim - rotary_dim elements pass through (partial rotary, as in Phi / GLM).
The multimodal variant (Qwen3-VL interleaved M-RoPE) takes three position streams
(temporal, height, width) and gives pair i the position of stream i mod 3; with
`mrope_section = (t, h, w)` a pair uses stream 1 only while i < 3h and stream 2 only while
i < 3w, else stream 0, exactly as transformers' Qwen3-VL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError, InvalidInput
from . import api, validate
from .dispatch import Op, select_backend
from .batch import PagedLayer
from .dispatch import BackendChoice


@dataclass(frozen=True, eq=False)
class NormSpec:
    """Per-head RMSNorm: y = x / sqrt(mean(x^2) + eps) * w over head_dim.

    weight: float [head_dim], shared by all heads. unit_offset: use (1 + weight), as Gemma does.
    """

    weight: torch.Tensor
    eps: float = 1e-6
    unit_offset: bool = False


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """Rotary position embedding settings.

    theta: base of the default inverse frequencies theta ** (-2i / rotary_dim).
    rotary_dim: elements rotated (even, <= head_dim); None = head_dim.
    inv_freq: optional float32 [rotary_dim // 2] overriding theta (scaled RoPE variants).
    attention_scaling: multiplies cos and sin (HF's attention factor; 1.0 for plain RoPE).
    multimodal: positions are [3, T] streams and pair i takes stream i mod 3.
    mrope_section: optional (t, h, w) pair counts limiting streams 1 and 2 (Qwen3-VL).
    """

    theta: float = 10000.0
    rotary_dim: Optional[int] = None
    inv_freq: Optional[torch.Tensor] = None
    attention_scaling: float = 1.0
    multimodal: bool = False
    mrope_section: Optional[tuple[int, int, int]] = None

    def dim(self, head_dim: int) -> int:
        rd = head_dim if self.rotary_dim is None else self.rotary_dim
        if isinstance(rd, bool) or not isinstance(rd, int) or rd < 2 or rd % 2 or rd > head_dim:
            raise ConfigError(f"rotary_dim must be an even int in [2, head_dim={head_dim}], got {rd!r}")
        return rd

    def frequencies(self, head_dim: int, device) -> torch.Tensor:
        """float32 [rotary_dim // 2] inverse frequencies."""
        rd = self.dim(head_dim)
        if self.inv_freq is not None:
            if tuple(self.inv_freq.shape) != (rd // 2,):
                raise ConfigError(f"inv_freq must have shape [{rd // 2}], got {list(self.inv_freq.shape)}")
            return self.inv_freq.to(device, torch.float32)
        if not self.theta > 0:
            raise ConfigError(f"rope theta must be > 0, got {self.theta!r}")
        exponent = torch.arange(0, rd, 2, dtype=torch.int64, device=device).float() / rd
        return 1.0 / (self.theta ** exponent)

    def pair_streams(self, pairs: int, device) -> torch.Tensor:
        """int64 [pairs]: which position stream each rotary pair uses (multimodal only)."""
        i = torch.arange(pairs, device=device)
        stream = i % 3
        if self.mrope_section is not None:
            _, h, w = self.mrope_section
            stream = torch.where((stream == 1) & (i >= 3 * h), 0, stream)
            stream = torch.where((stream == 2) & (i >= 3 * w), 0, stream)
        return stream


def rope_angles(rope: RopeSpec, positions: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Angles float32 [T, rotary_dim // 2] for positions int [T] (or [3, T] when multimodal)."""
    freqs = rope.frequencies(head_dim, positions.device)
    if rope.multimodal:
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise InvalidInput(f"multimodal RoPE needs positions [3, T], got {list(positions.shape)}")
        per_stream = positions.float()[..., None] * freqs  # [3, T, P]
        streams = rope.pair_streams(freqs.shape[0], positions.device)
        return per_stream.gather(0, streams[None, None, :].expand(1, positions.shape[1], -1))[0]
    if positions.dim() != 1:
        raise InvalidInput(f"RoPE needs positions [T], got {list(positions.shape)}")
    return positions.float()[:, None] * freqs


def rms_norm(x: torch.Tensor, norm: NormSpec) -> torch.Tensor:
    """float32 per-head RMSNorm of x [..., D]."""
    xf = x.float()
    w = norm.weight.to(xf.device, torch.float32)
    if norm.unit_offset:
        w = 1.0 + w
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps) * w


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeSpec) -> torch.Tensor:
    """float32 RoPE of x [T, H, D] (neox half split within the first rotary_dim elements)."""
    xf = x.float()
    d = xf.shape[-1]
    rd = rope.dim(d)
    angles = rope_angles(rope, positions, d)[:, None, :]  # [T, 1, P]
    cos, sin = angles.cos() * rope.attention_scaling, angles.sin() * rope.attention_scaling
    x1, x2, rest = xf[..., : rd // 2], xf[..., rd // 2 : rd], xf[..., rd:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, norm: Optional[NormSpec],
              rope: Optional[RopeSpec]) -> torch.Tensor:
    """x float [T, H, D] -> float32 [T, H, D]: RMSNorm (if norm) then RoPE (if rope), no rounding."""
    y = rms_norm(x, norm) if norm is not None else x.float()
    return apply_rope(y, positions, rope) if rope is not None else y


def _check_fused(layer: PagedLayer, k, positions, norm, rope, slot_mapping) -> None:
    if norm is not None:
        if not isinstance(norm, NormSpec):
            raise InvalidInput(f"norm must be a NormSpec or None, got {type(norm).__name__}")
        if tuple(norm.weight.shape) != (layer.head_dim,):
            raise InvalidInput(f"norm.weight must have shape [{layer.head_dim}], got {list(norm.weight.shape)}")
        if not norm.eps >= 0:
            raise InvalidInput(f"norm.eps must be >= 0, got {norm.eps!r}")
    if rope is not None:
        if not isinstance(rope, RopeSpec):
            raise InvalidInput(f"rope must be a RopeSpec or None, got {type(rope).__name__}")
        want = (3, k.shape[0]) if rope.multimodal else (k.shape[0],)
        if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
            raise InvalidInput(f"positions must be an int32/int64 tensor {list(want)}, got {positions!r}")
        if tuple(positions.shape) != want or positions.device != layer.device:
            raise InvalidInput(
                f"positions must have shape {list(want)} on {layer.device}, got "
                f"{list(positions.shape)} on {positions.device}"
            )


@torch.no_grad()
def store_k_fused(layer: PagedLayer, k: torch.Tensor, slot_mapping: torch.Tensor,
                  positions: Optional[torch.Tensor], *, norm: Optional[NormSpec] = None,
                  rope: Optional[RopeSpec] = None, backend: BackendChoice = None,
                  checks: bool = True) -> torch.Tensor:
    """Normalise, rotate and store raw keys; returns the fp32 keys that were stored.

    k: float [T, num_kv_heads, head_dim] (projection output, before norm and RoPE);
    slot_mapping: int64 [T] (negative = skip); positions: int [T] ([3, T] when
    rope.multimodal; unused without rope). Returns float32 [T, H, D] (before k_mult and k_centre,
    which the store applies: `pagedkv.ops.transform`).
    """
    validate.check_store(layer, k, None, slot_mapping, checks)
    _check_fused(layer, k, positions, norm, rope, slot_mapping)
    if rope is not None:
        rope.dim(layer.head_dim)  # ConfigError before any write
    impl = select_backend(Op.STORE, layer.device, layer, None, backend)
    if impl.store_k_fused is not None:  # the backend's own fused kernel
        return impl.store_k_fused(layer, k, slot_mapping, positions, norm=norm, rope=rope)
    kf = norm_rope(k, positions, norm, rope)
    impl.store(layer, kf, None, slot_mapping)
    return kf


def store_v(layer: PagedLayer, v: torch.Tensor, slot_mapping: torch.Tensor, *,
            backend: BackendChoice = None, checks: bool = True) -> None:
    """Store values only: v float [T, num_kv_heads, head_dim]; slot_mapping int64 [T]."""
    api.store(layer, None, v, slot_mapping, backend=backend, checks=checks)
