"""Triton device functions shared by the kernels: reading codes from the pools, small-float rounding.

Every non-bf16 codec decodes as `value_table[code] * scale` (docs/internals.md), so one reader
serves the whole catalogue: the code of element d sits at bit `d * BITS` of the row's
little-endian bit stream (true of the 2-, 3-, 4-, 8- and 16-bit layouts alike), the value comes
from the codec's table (a tiny cached tensor) and the scale from the row's scale bytes, the
layer's fp32 tensor scale, or nothing. The rounding helpers reproduce torch's conversions
bit for bit with integer arithmetic (round to nearest even, E4M3 saturating at 448) so the store
kernel writes the same bytes as the reference encoder on every device.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .spec import SCALE_BF16, SCALE_E4M3, SCALE_FP16, SCALE_TENSOR, VAL_E4M3, VAL_INT4, VAL_INT8

_VAL_E4M3 = tl.constexpr(VAL_E4M3)
_VAL_INT8 = tl.constexpr(VAL_INT8)
_VAL_INT4 = tl.constexpr(VAL_INT4)
_SCALE_TENSOR = tl.constexpr(SCALE_TENSOR)
_SCALE_E4M3 = tl.constexpr(SCALE_E4M3)
_SCALE_BF16 = tl.constexpr(SCALE_BF16)
_SCALE_FP16 = tl.constexpr(SCALE_FP16)


@triton.jit
def load_rows(pool_ptr, table_ptr, e4m3_ptr, tensor_scale, row_off, scale_off, offs_d, mask,
              BITS: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr, VALUES: tl.constexpr):
    """Decode a tile of rows to float32 [N, BLOCK_D] in the stored (rotated) basis.

    row_off: int64 [N, 1] byte offset of each row's codes in the pool; scale_off: int64 [N, 1]
    offset of its scales; offs_d: int32 [1, BLOCK_D] element index; mask: bool [N, BLOCK_D]
    (masked elements read nothing and decode to 0). VALUES: table gather or arithmetic decode
    (spec.VAL_*); E4M3 scales are decoded arithmetically too (e4m3_ptr is kept for callers).
    """
    bit = offs_d * BITS
    byte = bit >> 3
    b0 = tl.load(pool_ptr + row_off + byte, mask=mask, other=0).to(tl.int32)
    if BITS == 3 or BITS == 16:  # a code may straddle two bytes / a bf16 spans two
        b1 = tl.load(pool_ptr + row_off + byte + 1, mask=mask, other=0).to(tl.int32)
        word = b0 | (b1 << 8)
    else:
        word = b0
    if BITS == 16:
        val = (word << 16).to(tl.float32, bitcast=True)
    else:
        code = (word >> (bit & 7)) & ((1 << BITS) - 1)
        if VALUES == _VAL_E4M3:
            val = e4m3_value(code)
        elif VALUES == _VAL_INT8:
            val = ((code ^ 0x80) - 0x80).to(tl.float32)
        elif VALUES == _VAL_INT4:
            val = (code - 8).to(tl.float32)
        else:
            val = tl.load(table_ptr + code, mask=mask, other=0.0)
        if SCALE_KIND == _SCALE_TENSOR:
            val = val * tensor_scale
        elif SCALE_KIND == _SCALE_E4M3:
            sb = tl.load(pool_ptr + scale_off + offs_d // GROUP, mask=mask, other=0).to(tl.int32)
            val = val * e4m3_value(sb)
        elif SCALE_KIND == _SCALE_BF16 or SCALE_KIND == _SCALE_FP16:
            sp = pool_ptr + scale_off + (offs_d // GROUP) * 2
            s0 = tl.load(sp, mask=mask, other=0).to(tl.int32)
            s1 = tl.load(sp + 1, mask=mask, other=0).to(tl.int32)
            sw = s0 | (s1 << 8)
            if SCALE_KIND == _SCALE_BF16:
                s = (sw << 16).to(tl.float32, bitcast=True)
            else:
                s = sw.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            val = val * s
    return val


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """fp32 a [M, K] @ fp32 b [K, N] with an fp32 accumulator. DOT picks the operand precision:
    "ieee" (exact fp32 products, CUDA cores), "tf32" or "bf16" (operands rounded, tensor cores);
    "bf16-emulated": bf16-rounded operands multiplied in fp32 (the interpreter's dot treats bf16
    storage as integers, so the launchers use this there)."""
    if DOT == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    elif DOT == "bf16-emulated":
        return tl.dot(bf16_round(a), bf16_round(b), input_precision="ieee", out_dtype=tl.float32)
    else:
        return tl.dot(a, b, input_precision=DOT, out_dtype=tl.float32)


@triton.jit
def e4m3_value(b):
    """int32 E4M3 byte -> float32 without a table: move sign / exponent / mantissa into an fp16
    (exponent bias 15 vs 7, so scale by 2**8); exact for every finite E4M3 value, subnormals
    included."""
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def round_half_even(y):
    """float32 -> float32 rounded to the nearest integer, ties to even (torch.round); |y| < 2**23."""
    f = tl.floor(y)
    diff = y - f
    odd = (f.to(tl.int32) & 1) == 1
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return f + up.to(tl.float32)


@triton.jit
def e4m3_bits(v):
    """float32 -> int32 E4M3 byte (0..255): saturate at +-448, round to nearest even, keep -0."""
    raw = v.to(tl.int32, bitcast=True)
    sign = (raw >> 31) & 1
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    sub = round_half_even(a * 512.0).to(tl.int32)  # subnormals: multiples of 2**-9
    code = tl.where(a < 0.015625, sub, normal)
    return code | (sign << 7)


@triton.jit
def bf16_bits(v):
    """float32 -> int32 bf16 bit pattern (0..65535), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    r = bits + 0x7FFF + ((bits >> 16) & 1)
    return (r >> 16) & 0xFFFF


@triton.jit
def bf16_round(v):
    """float32 -> float32 holding the nearest bf16 (ties to even)."""
    return (bf16_bits(v) << 16).to(tl.float32, bitcast=True)


@triton.jit
def fp16_bits(v):
    """float32 -> int32 fp16 bit pattern (0..65535), round to nearest even."""
    return v.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def soft_cap_logits(s, cap):
    """cap * tanh(s / cap), written with exp so it runs everywhere (interpreter included)."""
    t = 2.0 * s / cap
    return cap * (1.0 - 2.0 / (tl.exp(t) + 1.0))
