"""Value tables: what each code means before the group scale, and the fitted turbo codebooks.

Every non-bf16 codec decodes as `value_table[code] * scale`, which is what lets one kernel serve
the whole catalogue. The turbo codebooks start from the exact N(0,1) Lloyd-Max levels and are then
fitted (Lloyd's fixed point, alternating with the encoder's own scale search) to the values the
codebook really sees: seeded N(0,1) vectors divided by their chosen per-16 E4M3 scale. Levels are
rounded to multiples of 2**-12 so that the table is the same on every machine.

The fit takes seconds, so its result ships with the package (`codebooks.json`, written by
`python -m pagedkv.codecs.tables`); a test refits and compares. Were the file missing, the
codebook is fitted at first use.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import torch

from .floats import e2m1_table, e4m3_table, e5m2_table
from .kinds import ValueKind
from .lloyd_max import fit_levels, gaussian_levels

if TYPE_CHECKING:  # a row's `value_table` calls down here: only the kinds at run time
    from .row import Codec

FIT_SEED = 20240917
FIT_GROUPS = 1 << 14
FIT_ROUNDS = 6
LEVEL_QUANTUM = 2.0**-12


@functools.lru_cache(maxsize=None)
def _int_table(bits: int) -> torch.Tensor:
    if bits == 8:  # byte b is the two's complement int8
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8).float()
    return torch.arange(2**bits, dtype=torch.float32) - 2 ** (bits - 1)  # int4: u - 8


CODEBOOK_FILE = Path(__file__).with_name("codebooks.json")


def _key(bits: int, group_size: int) -> str:
    return f"lloyd-max-{bits}bit-group{group_size}"


@functools.lru_cache(maxsize=None)
def _shipped() -> dict:
    try:
        return json.loads(CODEBOOK_FILE.read_text())
    except (OSError, ValueError):
        return {}


@functools.lru_cache(maxsize=None)
def lloyd_max_table(bits: int, group_size: int) -> torch.Tensor:
    """float32 [2**bits] ascending levels fitted to group-scaled N(0,1) (see module doc)."""
    quanta = _shipped().get(_key(bits, group_size))
    if quanta is not None and len(quanta) == 2**bits:
        return torch.tensor(quanta, dtype=torch.float64).mul(LEVEL_QUANTUM).float()
    return fit_lloyd_max_table(bits, group_size)


def fit_lloyd_max_table(bits: int, group_size: int) -> torch.Tensor:
    """Run the fit of the module doc (deterministic: seeded, rounded to LEVEL_QUANTUM)."""
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
    """float32 [2**code_bits] for codecs with codes, None for raw bf16 / f16 (see Codec.value_table)."""
    kind = codec.values
    if kind in (ValueKind.BF16, ValueKind.FP16):
        return None
    if kind is ValueKind.FP8_E4M3:
        return e4m3_table()
    if kind is ValueKind.FP8_E5M2:
        return e5m2_table()
    if kind is ValueKind.E2M1:
        return e2m1_table()
    if kind is ValueKind.INT:
        return _int_table(codec.code_bits).clone()
    if kind is ValueKind.LLOYD_MAX:
        return lloyd_max_table(codec.code_bits, codec.group_size).clone()
    raise AssertionError(f"no value table for {kind}")


def write_codebooks(codecs: Iterable["Codec"]) -> dict:
    """Fit the codebook of every turbo codec of `codecs` (the catalogue's rows) and write
    codebooks.json (levels in LEVEL_QUANTUM units)."""
    out = {}
    for codec in codecs:
        if codec.values is ValueKind.LLOYD_MAX:
            levels = fit_lloyd_max_table(codec.code_bits, codec.group_size)
            out[_key(codec.code_bits, codec.group_size)] = [
                int(v) for v in torch.round(levels / LEVEL_QUANTUM).tolist()
            ]
    CODEBOOK_FILE.write_text(json.dumps(out, indent=1) + "\n")
    _shipped.cache_clear()
    lloyd_max_table.cache_clear()
    return out


if __name__ == "__main__":
    from .catalogue import CODECS

    for name, quanta in write_codebooks(CODECS.values()).items():
        print(name, [q * LEVEL_QUANTUM for q in quanta])
