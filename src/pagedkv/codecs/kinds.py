"""The kinds a codec row is made of: how its scales are stored (`ScaleType`) and what a code
means (`ValueKind`). A leaf: everything that reads a row's kinds (the row, its derived traits, the
value tables, the reference codecs) imports them from here, none of them from each other."""

from __future__ import annotations

import enum


class ScaleType(enum.Enum):
    """How a codec's scales are stored."""

    NONE = "none"  # raw values, no scale (bf16)
    TENSOR_FP32 = "tensor-fp32"  # one fp32 scale per layer and side, outside the blocks (fp8)
    FP8_E4M3 = "fp8-e4m3"  # one byte per group
    BF16 = "bf16"  # two bytes per group, little-endian
    FP16 = "fp16"  # two bytes per group, little-endian

    @property
    def bytes_per_group(self) -> int:
        return _SCALE_BYTES[self]


_SCALE_BYTES = {
    ScaleType.NONE: 0, ScaleType.TENSOR_FP32: 0, ScaleType.FP8_E4M3: 1, ScaleType.BF16: 2, ScaleType.FP16: 2,
}


class ValueKind(enum.Enum):
    """What a code means before the scale is applied."""

    BF16 = "bf16"  # the code is the value
    FP16 = "fp16"  # the code is the value, an IEEE half
    FP8_E4M3 = "fp8-e4m3"  # an E4M3 float
    FP8_E5M2 = "fp8-e5m2"  # an E5M2 float
    E2M1 = "e2m1"  # an FP4 E2M1 float (sign bit 3)
    LLOYD_MAX = "lloyd-max"  # an index into the codec's fitted Lloyd-Max levels
    INT = "int"  # a signed integer (int8, or int4 stored as u - 8)
