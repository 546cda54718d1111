"""Reference encode/decode of every codec in the catalogue (readable torch, any device).

Scale rules (chosen to minimise squared error):
- nvfp4, turbo2/3/4 (table codes + one E4M3 scale per 16): the scale starts at
  amax / max|level| and the encoder tries the E4M3 values from 5 codes below to 4 codes above it
  (E4M3 bytes of positive values are monotonic), keeping the one with the least squared error of
  the group; each element takes the nearest level. A group of zeros stores scale 0.
- turbo8: bf16 scale amax / 448 per 16, values E4M3 of x / scale.
- q8_0: fp16 d = amax / 127, q = round(x / d) (llama.cpp). q4_0: d = m / -8 with m the element of
  largest magnitude, u = min(15, floor(x / d + 8.5)), value (u - 8) d (llama.cpp); the nibbles
  use our generic 4-bit order (element 2i low), not ggml's in-block order. d saturates at the
  largest finite fp16 (65504), so huge finite inputs clip rather than decode to NaN.
- fp8: E4M3 of x / tensor_scale, saturating at +-448; fp8_e5m2: E5M2 of x / tensor_scale,
  saturating at +-57344 (vLLM's fp8_e5m2 bytes; the front doors leave its scale at 1.0).
- bf16: round to nearest even; f16: round to nearest even IEEE half, saturating at +-65504
  (llama.cpp's f16 would store an infinity there).
Rotated codecs encode rotate(x). NaN or Inf in x raises InvalidInput. Which rule a row uses is
derived from the row (`derive.traits`); the integer rules take their constants from the code
width (2**(bits-1) - 1 and -2**(bits-1)), so a q5 row would be llama.cpp's q5_0 rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import InvalidInput
from . import packing, wht
from .derive import DecodeKind, EncodeRule, traits
from .floats import FP16_MAX, from_e4m3_bytes, from_half_bytes, to_e4m3_bytes, to_e5m2_bytes, to_half_bytes
from .kinds import ScaleType

if TYPE_CHECKING:
    from .row import Codec

SCALE_SEARCH = range(-5, 5)  # E4M3 code offsets tried around amax / max|level|
_HALF = {ScaleType.BF16: torch.bfloat16, ScaleType.FP16: torch.float16}


SEARCH_SLICE = 4096  # groups searched at a time: bounds the encoder's working set (~1 MB)


def level_order(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A value table's levels ascending and the code of each, as every encoder takes them (the
    reference, the C and the Triton stores): sorted on the CPU by a stable sort, so that equal
    levels (E2M1's +0 and -0) keep code order on every device. Which code of an equal pair a value
    gets is part of the stored bytes; CUDA's default sort put -0 first, so the reference on a GPU
    wrote other zero codes than the kernels."""
    levels, order = table.detach().cpu().sort(stable=True)
    return levels, order


def search_group_scales(x: torch.Tensor, levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best E4M3 scale per group and the nearest-level indices.

    x: float32 [N, G]; levels: float32 [L] ascending. Returns (scale float32 [N] exactly
    representable in E4M3, idx int64 [N, G] into `levels`). The candidates are tried one at a
    time (ties keep the smaller scale) on slices of SEARCH_SLICE groups, so the temporaries stay
    small whatever N is.
    """
    levels = levels.to(x.device)
    mids = (levels[1:] + levels[:-1]) / 2
    top = levels.abs().max()
    scales, indices = [], []
    for part in x.split(SEARCH_SLICE):
        amax = part.abs().amax(-1)
        base = to_e4m3_bytes(amax / top).to(torch.int32)  # [n]
        best_err = torch.full_like(amax, float("inf"))
        best_scale = torch.zeros_like(amax)
        best_idx = torch.zeros(part.shape, dtype=torch.long, device=x.device)
        for offset in SCALE_SEARCH:
            cand = from_e4m3_bytes((base + offset).clamp(1, 0x7E).to(torch.uint8))  # [n]
            idx = nearest_level(part / cand[:, None], mids)  # [n, G]
            err = (part - levels[idx] * cand[:, None]).square_().sum(-1)  # [n]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, cand, best_scale)
            best_idx = torch.where(better[:, None], idx, best_idx)
        scales.append(torch.where(amax == 0, torch.zeros_like(best_scale), best_scale))
        indices.append(best_idx)
    if not scales:
        return x.new_zeros(0), torch.zeros(x.shape, dtype=torch.long, device=x.device)
    return torch.cat(scales), torch.cat(indices)


def nearest_level(y: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    """Index of the nearest ascending level for each element (ties go down), int64.

    Counting the midpoints below each value is ~3x faster than torch.bucketize for <= 16 levels.
    """
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for m in mids.tolist():
        idx += y > m
    return idx.long()


def _half_scale(d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A group scale rounded to its half-precision storage, saturating at the type's largest
    finite value (fp16: 65504): |x| past 127 * 65504 (q8_0) or 8 * 65504 (q4_0) then clips
    instead of storing an infinite scale that decodes to NaN (0 * inf)."""
    top = torch.finfo(dtype).max
    return d.clamp(-top, top).to(dtype).float()


def _check_input(codec: Codec, x: torch.Tensor) -> None:
    if not torch.is_floating_point(x):
        raise InvalidInput(f"{codec.name} encode needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise InvalidInput(f"{codec.name} encode needs a tensor [..., head_dim], got a scalar")
    try:
        codec.check_head_dim(int(x.shape[-1]))
    except Exception as exc:
        raise InvalidInput(str(exc)) from None
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise InvalidInput(f"{codec.name} encode got NaN or Inf values")


def encode(codec: Codec, x: torch.Tensor, tensor_scale: float | None = None):
    """x float [..., D] -> (data uint8 [..., row_data_bytes], scales uint8 [..., row_scale_bytes])."""
    _check_input(codec, x)
    d = x.shape[-1]
    lead = x.shape[:-1]
    xf = wht.rotate(x) if codec.rotated else x.float()
    empty = torch.empty(*lead, 0, dtype=torch.uint8, device=x.device)
    t = traits(codec)
    rule = t.encode

    if rule is EncodeRule.ROUND_BF16:
        return to_half_bytes(xf, torch.bfloat16), empty
    if rule is EncodeRule.ROUND_FP16:
        return to_half_bytes(xf.clamp(-FP16_MAX, FP16_MAX), torch.float16), empty
    if rule in (EncodeRule.E4M3_TENSOR, EncodeRule.E5M2_TENSOR):
        s = 1.0 if tensor_scale is None else float(tensor_scale)
        if not s > 0:
            raise InvalidInput(f"{codec.name} tensor_scale must be > 0, got {tensor_scale!r}")
        to_bytes = to_e4m3_bytes if rule is EncodeRule.E4M3_TENSOR else to_e5m2_bytes
        return to_bytes(xf / s), empty

    groups = xf.reshape(-1, t.group)  # [N, G]
    amax = groups.abs().amax(-1)
    if rule is EncodeRule.E4M3_GROUP:  # turbo8
        half = _HALF[t.scale]
        scale = from_half_bytes(to_half_bytes((amax / 448.0)[:, None], half), half).squeeze(-1)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = to_e4m3_bytes(groups / safe[:, None])
        scale_bytes = to_half_bytes(scale[:, None], half)
    elif rule is EncodeRule.INT_AMAX:  # q8_0: d = amax / 127, q = round(x / d)
        top = float((1 << (t.bits - 1)) - 1)
        dq = _half_scale(amax / top, _HALF[t.scale])
        safe = torch.where(dq > 0, dq, torch.ones_like(dq))
        q = torch.round(groups / safe[:, None]).clamp(-top, top)
        codes = q.to(torch.int8).view(torch.uint8)
        scale_bytes = to_half_bytes(dq[:, None], _HALF[t.scale])
    elif rule is EncodeRule.INT_SIGNED_MAX:  # q4_0: d = m / -8, u = min(15, floor(x / d + 8.5))
        half = float(1 << (t.bits - 1))
        pos = groups.abs().argmax(-1, keepdim=True)
        m = groups.gather(1, pos).squeeze(1)
        dq = _half_scale(m / -half, _HALF[t.scale])
        safe = torch.where(dq != 0, dq, torch.ones_like(dq))
        u = torch.floor(groups / safe[:, None] + (half + 0.5)).clamp(0, 2 * half - 1)
        codes = u.to(torch.uint8)
        scale_bytes = to_half_bytes(dq[:, None], _HALF[t.scale])
    elif rule is EncodeRule.TABLE_SEARCH:  # nvfp4, turbo2/3/4: levels with an E4M3 group scale
        levels, order = level_order(codec.value_table())
        scale, idx = search_group_scales(groups, levels)
        codes = order.to(x.device)[idx].to(torch.uint8)
        scale_bytes = to_e4m3_bytes(scale[:, None])
    else:  # pragma: no cover - derive.traits only yields the rules above
        raise AssertionError(f"no encoder for {rule}")

    data = packing.pack(codes.reshape(*lead, d), codec.code_bits)
    scales = scale_bytes.reshape(*lead, codec.row_scale_bytes(d))
    return data, scales


def decode(
    codec: Codec,
    data: torch.Tensor,
    scales: torch.Tensor,
    head_dim: int,
    tensor_scale: float | None = None,
    rotated_basis: bool = False,
) -> torch.Tensor:
    """(data, scales) -> float32 [..., head_dim]; `rotated_basis` skips the inverse rotation."""
    lead = data.shape[:-1]
    if data.shape[-1] != codec.row_data_bytes(head_dim):
        raise InvalidInput(
            f"{codec.name} data rows must have {codec.row_data_bytes(head_dim)} bytes for "
            f"head_dim {head_dim}, got {data.shape[-1]}"
        )
    t = traits(codec)
    if t.decode is DecodeKind.RAW_BF16:
        out = from_half_bytes(data, torch.bfloat16)
    elif t.decode is DecodeKind.RAW_FP16:
        out = from_half_bytes(data, torch.float16)
    else:  # every other decode kind is value_table[code] (the table is the definition)
        codes = packing.unpack(data, codec.code_bits, head_dim).long()
        table = codec.value_table().to(data.device)
        vals = table[codes]
        if t.scale is ScaleType.TENSOR_FP32:
            out = vals * (1.0 if tensor_scale is None else float(tensor_scale))
        else:
            g = t.group
            if t.scale is ScaleType.FP8_E4M3:
                s = from_e4m3_bytes(scales)
            else:
                s = from_half_bytes(scales, _HALF[t.scale])
            out = (vals.reshape(*lead, head_dim // g, g) * s.reshape(*lead, head_dim // g, 1))
            out = out.reshape(*lead, head_dim)
    if codec.rotated and not rotated_basis:
        out = wht.unrotate(out)
    return out


def roundtrip(codec: Codec, x: torch.Tensor, tensor_scale: float | None = None) -> torch.Tensor:
    """decode(encode(x)) in the original basis, float32."""
    data, scales = encode(codec, x, tensor_scale)
    return decode(codec, data, scales, x.shape[-1], tensor_scale)
