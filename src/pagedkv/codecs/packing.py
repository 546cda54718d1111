"""Bit packing of codes along the last dim; the bit order is part of the storage format.

Every width is one LSB-first bit stream along the row: element i occupies bits b*i .. b*i+b-1
of the row read as a little-endian integer. So 8 elements fill b bytes; with
w = b0 | b1<<8 | ... (b bytes), element 8i+j = (w >> bj) & (2**b - 1). Spelled out:
4-bit: byte i = element 2i (bits 0-3) | element 2i+1 (bits 4-7).
3-bit: 8 elements -> 3 bytes; with w = b0 | b1<<8 | b2<<16, element 8i+j = (w >> 3j) & 7.
2-bit: byte i holds element 4i+j in bits 2j..2j+1.
8-bit: one byte per element. Other widths (1, 5, 6, 7) use the same stream, 8 codes at a time.
"""

from __future__ import annotations

import torch

from ..errors import InvalidInput

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def _check(bits: int, n: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise InvalidInput(f"code bits must be one of {SUPPORTED_BITS}, got {bits}")
    per = {2: 4, 4: 2, 8: 1}.get(bits, 8)
    if n % per:
        raise InvalidInput(f"{bits}-bit packing needs a multiple of {per} codes per row, got {n}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (each < 2**bits) -> uint8 [..., n * bits / 8]."""
    _check(bits, codes.shape[-1])
    c = codes.to(torch.uint8)
    lead, n = c.shape[:-1], c.shape[-1]
    if bits == 8:
        return c.contiguous()
    if bits == 4:
        return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()
    if bits == 2:
        g = c.reshape(*lead, n // 4, 4)
        return (g[..., 0] | (g[..., 1] << 2) | (g[..., 2] << 4) | (g[..., 3] << 6)).contiguous()
    g = c.reshape(*lead, n // 8, 8).to(torch.int64)  # 8 codes -> one word of `bits` bytes
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=c.device)
    w = (g << shifts).sum(-1)
    out = torch.stack([(w >> (8 * k)) & 255 for k in range(bits)], -1)
    return out.to(torch.uint8).reshape(*lead, n // 8 * bits)


def unpack(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 [..., n * bits / 8] -> uint8 codes [..., n]."""
    _check(bits, n)
    d = data
    lead = d.shape[:-1]
    if bits == 8:
        return d
    if bits == 4:
        return torch.stack([d & 15, d >> 4], -1).reshape(*lead, n)
    if bits == 2:
        return torch.stack([(d >> s) & 3 for s in (0, 2, 4, 6)], -1).reshape(*lead, n)
    b = d.reshape(*lead, n // 8, bits).to(torch.int64)
    w = b[..., 0]
    for k in range(1, bits):
        w = w | (b[..., k] << (8 * k))
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=d.device)
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8).reshape(*lead, n)
