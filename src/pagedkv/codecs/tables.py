"""Value tables: what each code means before the group scale, and the fitted turbo codebooks.

Every non-bf16 codec decodes as `value_table[code] * scale`, which is what lets one kernel serve
the whole catalogue. The turbo codebooks start from the exact N(0,1) Lloyd-Max levels and are then
fitted (Lloyd's fixed point, alternating with the encoder's own scale search) to the values the
codebook really sees: seeded N(0,1) vectors divided by their chosen per-16 E4M3 scale. Levels are
rounded to multiples of 2**-12 so that the table is the same on every machine.
"""

from __future__ import annotations

import functools

import torch

from .catalogue import Codec, ValueKind
from .floats import e2m1_table, e4m3_table
from .lloyd_max import fit_levels, gaussian_levels

FIT_SEED = 20240917
FIT_GROUPS = 1 << 14
FIT_ROUNDS = 6
LEVEL_QUANTUM = 2.0**-12


@functools.lru_cache(maxsize=None)
def _int_table(bits: int) -> torch.Tensor:
    if bits == 8:  # byte b is the two's complement int8
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).float()
    return torch.arange(2**bits, dtype=torch.float32) - 2 ** (bits - 1)  # int4: u - 8


@functools.lru_cache(maxsize=None)
def lloyd_max_table(bits: int, group_size: int) -> torch.Tensor:
    """float32 [2**bits] ascending levels fitted to group-scaled N(0,1) (see module doc)."""
    from .reference import search_group_scales  # the encoder's own scale rule

    gen = torch.Generator().manual_seed(FIT_SEED)
    x = torch.randn(FIT_GROUPS, group_size, generator=gen, dtype=torch.float64).float()
    x = torch.cat([x, -x])  # symmetric samples keep the codebook symmetric
    levels = torch.tensor(gaussian_levels(bits), dtype=torch.float32)
    for _ in range(FIT_ROUNDS):
        scale, _ = search_group_scales(x, levels)
        ok = scale > 0
        normed = (x[ok] / scale[ok, None]).flatten()
        levels = fit_levels(normed, levels, iters=20).float()
    return (torch.round(levels / LEVEL_QUANTUM) * LEVEL_QUANTUM).float()


def value_table(codec: Codec) -> torch.Tensor | None:
    """float32 [2**code_bits] for codecs with codes, None for bf16 (see Codec.value_table)."""
    kind = codec.values
    if kind is ValueKind.BF16:
        return None
    if kind is ValueKind.FP8_E4M3:
        return e4m3_table()
    if kind is ValueKind.E2M1:
        return e2m1_table()
    if kind is ValueKind.INT:
        return _int_table(codec.code_bits).clone()
    if kind is ValueKind.LLOYD_MAX:
        return lloyd_max_table(codec.code_bits, codec.group_size).clone()
    raise AssertionError(f"no value table for {kind}")
