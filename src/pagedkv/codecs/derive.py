"""Everything a backend needs to know about a codec, derived from its catalogue row in one place.

A row (`row.Codec`) says what is stored: code bits, what a code means (`ValueKind`), the
group size and scale type, whether the row is rotated. `traits(codec)` turns that into the four
facts every implementation switches on:
- `decode`: how a code becomes a value before the scale (`DecodeKind`): raw bf16 or IEEE half,
  an E4M3 float,
  a two's complement int8, an offset integer `u - 2**(bits-1)`, or a lookup in the value table
  (Lloyd-Max levels, E2M1, E5M2);
- `encode`: the rule that picks codes and scales (`EncodeRule`): round to bf16 or fp16 (saturating);
  E4M3 or E5M2 of x over the layer's tensor scale; E4M3 over a half-precision group scale amax / 448; integers over an fp16
  group scale (llama.cpp's q8_0 and q4_0 rules, generalised to the code width); the nearest table
  level under the best E4M3 group scale of a small search;
- `scale`: the scale's storage (`ScaleType`) and `group` (elements per scale, 0 = none);
- `bits`: the packing width: codes are an LSB-first bit stream along head_dim (`packing.py`), 16
  = one little-endian half per element.
A row this module cannot describe raises ConfigError naming the row and what is missing, so a new
row is either fully described here or refused everywhere; backends then declare which traits they
implement (`pagedkv.ops.support`) and the dispatcher enforces it.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .kinds import ScaleType, ValueKind

if TYPE_CHECKING:  # a row's `traits` calls down here: only the kinds at run time
    from .row import Codec


class DecodeKind(enum.Enum):
    """How a code becomes its value before the scale."""

    RAW_BF16 = "raw-bf16"  # 16-bit codes are bf16 values
    RAW_FP16 = "raw-fp16"  # 16-bit codes are IEEE half values
    E4M3 = "e4m3"  # 8-bit E4M3 float
    INT8 = "int8"  # two's complement byte
    INT_OFFSET = "int-offset"  # unsigned u of `bits` bits, value u - 2**(bits - 1)
    TABLE = "table"  # value_table[code] (Lloyd-Max levels, E2M1, ...)


class EncodeRule(enum.Enum):
    """How the encoder picks codes and scales (codecs/reference.py is the definition)."""

    ROUND_BF16 = "round-bf16"
    ROUND_FP16 = "round-fp16"  # round to nearest even IEEE half, saturating at +-65504
    E4M3_TENSOR = "e4m3-tensor-scale"  # E4M3 of x / the layer's fp32 scale, saturating at 448
    E5M2_TENSOR = "e5m2-tensor-scale"  # E5M2 of x / the layer's fp32 scale, saturating at 57344
    E4M3_GROUP = "e4m3-half-group-scale"  # half scale amax / 448 per group, E4M3 of x / scale
    INT_AMAX = "int-amax"  # d = amax / (2**(bits-1) - 1), q = round(x / d) (q8_0)
    INT_SIGNED_MAX = "int-signed-max"  # d = m / -2**(bits-1), m the largest-magnitude element (q4_0)
    TABLE_SEARCH = "table-e4m3-search"  # nearest level, best E4M3 group scale of a small search


@dataclass(frozen=True)
class CodecTraits:
    """What implementations switch on (see the module docstring); derived, never typed in."""

    decode: DecodeKind
    encode: EncodeRule
    scale: ScaleType
    bits: int
    group: int
    rotated: bool

    @property
    def levels(self) -> int:
        """Distinct codes (0 for raw 16-bit values)."""
        return 0 if self.bits > 8 else 1 << self.bits

    @property
    def per_group_scale(self) -> bool:
        return self.scale not in (ScaleType.NONE, ScaleType.TENSOR_FP32)

    @property
    def tensor_scaled(self) -> bool:
        """True when the row needs one fp32 scale per layer and side (fp8: calibrate it)."""
        return self.scale is ScaleType.TENSOR_FP32

    @property
    def raw(self) -> bool:
        """True when codes are the model's values (bf16, f16): nothing to centre or scale."""
        return self.decode in (DecodeKind.RAW_BF16, DecodeKind.RAW_FP16)


_HALF_SCALES = (ScaleType.BF16, ScaleType.FP16)


def _refuse(codec: Codec, why: str) -> ConfigError:
    return ConfigError(
        f"codec {codec.name!r} (values {codec.values.value}, {codec.code_bits} bits, group "
        f"{codec.group_size}, scale {codec.scale_type.value}) cannot be derived: {why}"
    )


@functools.lru_cache(maxsize=None)
def traits(codec: Codec) -> CodecTraits:
    """The CodecTraits of a catalogue row; ConfigError for a row no rule describes."""
    v, s, bits, g = codec.values, codec.scale_type, codec.code_bits, codec.group_size
    if bits != 16 and not 1 <= bits <= 8:
        raise _refuse(codec, "code bits must be 1..8 (packed) or 16 (raw halves)")
    grouped = s not in (ScaleType.NONE, ScaleType.TENSOR_FP32)
    if grouped != bool(g):
        raise _refuse(codec, "a per-group scale type needs a group size and only it has one")
    if v is ValueKind.BF16:
        if bits != 16 or s is not ScaleType.NONE:
            raise _refuse(codec, "bf16 values are raw 16-bit codes without a scale")
        decode, encode = DecodeKind.RAW_BF16, EncodeRule.ROUND_BF16
    elif v is ValueKind.FP16:
        if bits != 16 or s is not ScaleType.NONE:
            raise _refuse(codec, "fp16 values are raw 16-bit codes without a scale")
        decode, encode = DecodeKind.RAW_FP16, EncodeRule.ROUND_FP16
    elif bits == 16:
        raise _refuse(codec, "16-bit codes are only raw bf16 or fp16 values")
    elif v is ValueKind.FP8_E5M2:
        if bits != 8 or s is not ScaleType.TENSOR_FP32:
            raise _refuse(codec, "E5M2 values are 8-bit codes with a tensor scale")
        decode, encode = DecodeKind.TABLE, EncodeRule.E5M2_TENSOR
    elif v is ValueKind.FP8_E4M3:
        if bits != 8:
            raise _refuse(codec, "E4M3 values are 8-bit codes")
        if s is ScaleType.TENSOR_FP32:
            encode = EncodeRule.E4M3_TENSOR
        elif s in _HALF_SCALES:
            encode = EncodeRule.E4M3_GROUP
        else:
            raise _refuse(codec, "E4M3 values take a tensor scale or a bf16/fp16 group scale")
        decode = DecodeKind.E4M3
    elif v is ValueKind.INT:
        if s not in _HALF_SCALES or bits < 2:
            raise _refuse(codec, "integer codes take a bf16/fp16 group scale and >= 2 bits")
        if bits == 8:
            decode, encode = DecodeKind.INT8, EncodeRule.INT_AMAX
        else:
            decode, encode = DecodeKind.INT_OFFSET, EncodeRule.INT_SIGNED_MAX
    elif v in (ValueKind.E2M1, ValueKind.LLOYD_MAX):
        if s is not ScaleType.FP8_E4M3:
            raise _refuse(codec, "table codes take an E4M3 group scale (the encoder searches it)")
        if v is ValueKind.E2M1 and bits != 4:
            raise _refuse(codec, "E2M1 values are 4-bit codes")
        decode, encode = DecodeKind.TABLE, EncodeRule.TABLE_SEARCH
    else:
        raise _refuse(codec, f"no decode rule for value kind {v.value}")
    return CodecTraits(decode, encode, s, bits, g, codec.rotated)


def auto_high_precision_layers(codec: Codec) -> int:
    """How many first and last attention layers "auto" keeps in the high-precision format when
    `codec` stores the keys: max(0, 6 - code bits), so 16/8 bits -> 0, 4 -> 2, 3 -> 3, 2 -> 4 (the
    measured table this replaces) and every other width gets a value from the same rule (5 -> 1)
    instead of falling through to 0. ConfigError for a row `traits` refuses."""
    return max(0, 6 - traits(codec).bits)
