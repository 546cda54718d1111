"""Triton device functions shared by the kernels: reading codes from the pools, small-float rounding.

Every non-bf16 codec decodes as `value_table[code] * scale` (docs/internals.md), so one reader
serves the whole catalogue: the row's bytes are unpacked in registers into codes (2-, 3-, 4-,
5-, 8-bit layouts, or raw bf16), the value comes from the codec's table (a tiny cached tensor) or
from arithmetic (E4M3, int8, int4), the scale from the row's scale bytes, the layer's fp32
tensor scale, or nothing. The rounding helpers reproduce torch's conversions
bit for bit with integer arithmetic (round to nearest even, E4M3 saturating at 448) so the store
kernel writes the same bytes as the reference encoder on every device.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .spec import (SCALE_BF16, SCALE_E4M3, SCALE_FP16, SCALE_TENSOR, VAL_E4M3, VAL_INT4, VAL_INT8, VAL_TABLE,
                   VAL_TABLE_ODD)

_VAL_E4M3 = tl.constexpr(VAL_E4M3)
_VAL_INT8 = tl.constexpr(VAL_INT8)
_VAL_INT4 = tl.constexpr(VAL_INT4)
_VAL_TABLE = tl.constexpr(VAL_TABLE)
_VAL_TABLE_ODD = tl.constexpr(VAL_TABLE_ODD)
_SCALE_TENSOR = tl.constexpr(SCALE_TENSOR)
_SCALE_E4M3 = tl.constexpr(SCALE_E4M3)
_SCALE_BF16 = tl.constexpr(SCALE_BF16)
_SCALE_FP16 = tl.constexpr(SCALE_FP16)


@triton.jit
def _load_bytes(pool_ptr, row_off, row_ok, start, NB: tl.constexpr, STEP: tl.constexpr, VALID: tl.constexpr):
    """int32 [N, NB]: byte start + STEP * j of each row (j < VALID; others and masked rows 0)."""
    j = tl.arange(0, NB)
    m = row_ok[:, None] & (j < VALID)[None, :]
    return tl.load(pool_ptr + row_off[:, None] + start + j[None, :] * STEP, mask=m, other=0).to(tl.int32)


@triton.jit
def _le16(pool_ptr, row_off, row_ok, NW: tl.constexpr, VALID: tl.constexpr):
    """int32 [N, NW]: little-endian 16-bit words 0..NW-1 of each row (one contiguous byte load)."""
    b = _load_bytes(pool_ptr, row_off, row_ok, 0, 2 * NW, 1, 2 * VALID)
    lo, hi = tl.split(tl.reshape(b, (b.shape[0], NW, 2)))
    return lo | (hi << 8)


@triton.jit
def load_rows(pool_ptr, table_ptr, tensor_scale, row_off, scale_off, row_ok,
              D: tl.constexpr, BLOCK_D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
              SCALE_KIND: tl.constexpr, VALUES: tl.constexpr):
    """Decode N rows of D codes to float32 [N, BLOCK_D] in the stored (rotated) basis.

    row_off / scale_off: int64 [N] byte offsets of each row's codes / scales in the pool;
    row_ok: bool [N] (masked rows read nothing). Elements d >= D and masked rows decode to 0.
    The row's bytes are read contiguously (one lane per byte) and unpacked in registers: a
    4-bit byte gives codes 2i, 2i+1, a 2-bit byte 4i..4i+3, three 3-bit (five 5-bit) bytes
    8i..8i+7 (joined back into element order), so no byte is loaded twice. GROUP divides D
    (the catalogue's head_dim rule), so BLOCK_D // GROUP >= 1. VALUES: value-table gather or
    arithmetic decode (spec.VAL_*); E4M3 scales are decoded arithmetically.
    """
    N: tl.constexpr = row_off.shape[0]
    offs_d = tl.arange(0, BLOCK_D)
    if BITS == 16:
        val = (_le16(pool_ptr, row_off, row_ok, BLOCK_D, D) << 16).to(tl.float32, bitcast=True)
    else:
        if BITS == 8:
            code = _load_bytes(pool_ptr, row_off, row_ok, 0, BLOCK_D, 1, D)
        elif BITS == 4:
            b = _load_bytes(pool_ptr, row_off, row_ok, 0, BLOCK_D // 2, 1, D // 2)
            code = tl.reshape(tl.join(b & 15, b >> 4), (N, BLOCK_D))
        elif BITS == 2:
            b = _load_bytes(pool_ptr, row_off, row_ok, 0, BLOCK_D // 4, 1, D // 4)
            even = tl.join(b & 3, (b >> 4) & 3)
            odd = tl.join((b >> 2) & 3, (b >> 6) & 3)
            code = tl.reshape(tl.join(even, odd), (N, BLOCK_D))
        else:  # 3 or 5 bits: 8 codes in BITS bytes, w = b0 | b1 << 8 | ..., code j = (w >> BITS*j) & MASK
            tl.static_assert(BITS == 3 or BITS == 5, "load_rows unpacks 2/3/4/5/8-bit codes and bf16 (spec.SUPPORT)")
            NW: tl.constexpr = BLOCK_D // 8
            MASK: tl.constexpr = (1 << BITS) - 1
            w = _load_bytes(pool_ptr, row_off, row_ok, 0, NW, BITS, D // 8)
            for k in tl.static_range(1, min(BITS, 4)):  # the first 4 bytes as an int32
                w = w | (_load_bytes(pool_ptr, row_off, row_ok, k, NW, BITS, D // 8) << (8 * k))
            if BITS == 5:  # codes 6, 7 take bits 30-39: from the word's top 2 bits and byte 4
                b4 = _load_bytes(pool_ptr, row_off, row_ok, 4, NW, BITS, D // 8)
                c6 = ((w >> 30) & 3) | ((b4 & 7) << 2)
                c7 = b4 >> 3
            else:
                c6 = (w >> (6 * BITS)) & MASK
                c7 = (w >> (7 * BITS)) & MASK
            c04 = tl.join(w & MASK, (w >> (4 * BITS)) & MASK)
            c26 = tl.join((w >> (2 * BITS)) & MASK, c6)
            c15 = tl.join((w >> BITS) & MASK, (w >> (5 * BITS)) & MASK)
            c37 = tl.join((w >> (3 * BITS)) & MASK, c7)
            code = tl.reshape(tl.join(tl.join(c04, c26), tl.join(c15, c37)), (N, BLOCK_D))
        if VALUES == _VAL_E4M3:
            val = e4m3_value(code)
        elif VALUES == _VAL_INT8:
            val = ((code ^ 0x80) - 0x80).to(tl.float32)
        elif VALUES == _VAL_INT4:  # offset integer: code - 2**(BITS - 1)
            val = (code - (1 << (BITS - 1))).to(tl.float32)
        elif VALUES == _VAL_TABLE_ODD:  # table[c] = -table[c ^ MASK]: the lower half's tree, signed
            upper = code >= (1 << (BITS - 1))
            low = table_value(tl.where(upper, code ^ ((1 << BITS) - 1), code), table_ptr, BITS - 1)
            val = tl.where(upper, -low, low)
        else:
            tl.static_assert(VALUES == _VAL_TABLE, "unknown VALUES constexpr (spec.py derives it)")
            val = table_value(code, table_ptr, BITS)
        if SCALE_KIND == _SCALE_TENSOR:
            val = val * tensor_scale
        elif SCALE_KIND != 0:  # one scale per GROUP elements along the row
            NG: tl.constexpr = BLOCK_D // GROUP
            if SCALE_KIND == _SCALE_E4M3:
                s = e4m3_value(_load_bytes(pool_ptr, scale_off, row_ok, 0, NG, 1, D // GROUP))
            else:
                sw = _le16(pool_ptr, scale_off, row_ok, NG, D // GROUP)
                if SCALE_KIND == _SCALE_BF16:
                    s = (sw << 16).to(tl.float32, bitcast=True)
                else:
                    s = sw.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            val = tl.reshape(tl.reshape(val, (N, NG, GROUP)) * s[:, :, None], (N, BLOCK_D))
    return tl.where(row_ok[:, None] & (offs_d < D)[None, :], val, 0.0)


@triton.jit
def _lut2(code, t_ptr, BASE: tl.constexpr):
    """Table entries BASE..BASE+3 picked by code bits 0-1 (selects over 4 scalars: no gather)."""
    b0 = (code & 1) != 0
    lo = tl.where(b0, tl.load(t_ptr + BASE + 1), tl.load(t_ptr + BASE))
    hi = tl.where(b0, tl.load(t_ptr + BASE + 3), tl.load(t_ptr + BASE + 2))
    return tl.where((code & 2) != 0, hi, lo)


@triton.jit
def _lut3(code, t_ptr, BASE: tl.constexpr):
    return tl.where((code & 4) != 0, _lut2(code, t_ptr, BASE + 4), _lut2(code, t_ptr, BASE))


@triton.jit
def _lut4(code, t_ptr, BASE: tl.constexpr):
    return tl.where((code & 8) != 0, _lut3(code, t_ptr, BASE + 8), _lut3(code, t_ptr, BASE))


@triton.jit
def table_value(code, table_ptr, BITS: tl.constexpr):
    """float32 table[code] for int32 codes of a 2- to 5-bit table codec (Lloyd-Max levels,
    E2M1), as a tree of selects over the table's 2**BITS scalars instead of a per-element gather
    `tl.load(table + code)`, which was the one difference between the table codecs' decode and
    q4_0's when the first GPU run timed them far slower (docs/gpu.md). Other widths gather."""
    if BITS == 2:
        return _lut2(code, table_ptr, 0)
    elif BITS == 3:
        return _lut3(code, table_ptr, 0)
    elif BITS == 4:
        return _lut4(code, table_ptr, 0)
    elif BITS == 5:
        return tl.where((code & 16) != 0, _lut4(code, table_ptr, 16), _lut4(code, table_ptr, 0))
    else:
        return tl.load(table_ptr + code)


@triton.jit
def dot(a, b, DOT: tl.constexpr):
    """fp32 a [M, K] @ fp32 b [K, N] with an fp32 accumulator. DOT picks the operand precision:
    "ieee" (exact fp32 products on CUDA cores: register-hungry for big tiles), "tf32x3"
    (fp32-accurate products from three TF32 tensor-core products), "tf32" or "bf16" (operands
    rounded, tensor cores);
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
