"""Small-float conversions: E4M3 (torch's float8_e4m3fn), E5M2, E2M1 (FP4), bf16/fp16 as raw bytes.

E4M3 rounds to nearest even and saturates at +-448 (torch would turn overflow into NaN, so values
are clamped first); E5M2 likewise at +-57344 (never its infinity codes). E2M1 has 8 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; its nibble is sign bit 3
and the magnitude index in bits 0-2.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
FP16_MAX = 65504.0
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def to_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 E4M3 bit patterns (saturating), same shape."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def from_e4m3_bytes(b: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bit patterns -> float32, same shape."""
    return b.contiguous().view(torch.float8_e4m3fn).float()


def e4m3_table() -> torch.Tensor:
    """float32 [256]: the value of every E4M3 byte (the two NaN codes map to 0, never written)."""
    t = from_e4m3_bytes(torch.arange(256, dtype=torch.int32).to(torch.uint8))
    return torch.nan_to_num(t, nan=0.0)


def to_e5m2_bytes(x: torch.Tensor) -> torch.Tensor:
    """float -> uint8 E5M2 bit patterns (round to nearest even, saturating at +-57344: never
    the infinity or NaN codes), same shape."""
    return x.float().clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2).view(torch.uint8)


def e5m2_table() -> torch.Tensor:
    """float32 [256]: the value of every E5M2 byte (the infinity and NaN codes, never written,
    map to 0)."""
    t = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e5m2).float()
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def e2m1_table() -> torch.Tensor:
    """float32 [16]: the value of every E2M1 nibble."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float (already divided by the scale) -> uint8 nibbles (round to nearest magnitude)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    mids = (mags[1:] + mags[:-1]) / 2
    idx = torch.bucketize(x.abs().float(), mids)  # ties go to the lower magnitude
    sign = (x < 0).to(torch.uint8) << 3
    return (idx.to(torch.uint8) | sign)


def to_half_bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float -> little-endian bytes of bf16/fp16, shape [..., 2*n]."""
    h = x.to(dtype).contiguous()
    return h.view(torch.uint8).reshape(*x.shape[:-1], x.shape[-1] * 2)


def from_half_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """little-endian bytes [..., 2*n] of bf16/fp16 -> float32 [..., n]."""
    return b.contiguous().view(dtype).float()
