"""The codec row type (`Codec`): one frozen row of the catalogue and the sizes that follow from
it. A leaf below the catalogue (`catalogue.CODECS` holds the rows): the derived traits
(`derive.py`) and value tables (`tables.py`) are computed from a row by functions that import
only `kinds`, so the row's `traits` / `value_table` call down, never round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from .kinds import ScaleType, ValueKind


@dataclass(frozen=True)
class Codec:
    """One row of the catalogue.

    name: canonical name. code_bits: bits of one code in the data section. group_size: elements
    per scale along head_dim (0 when the codec has no per-group scale). rotated: stored after the
    orthonormal Walsh-Hadamard rotation over head_dim. description: one line for tables.
    """

    name: str
    code_bits: int
    values: ValueKind
    group_size: int
    scale_type: ScaleType
    rotated: bool
    description: str

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def scale_bytes_per_group(self) -> int:
        return self.scale_type.bytes_per_group if self.group_size else 0

    @property
    def bits_per_element(self) -> float:
        if not self.group_size:
            return float(self.code_bits)
        return self.code_bits + 8.0 * self.scale_bytes_per_group / self.group_size

    def data_bytes(self, elements: int) -> int:
        """Bytes of the data section holding `elements` codes."""
        return elements * self.code_bits // 8

    def scale_bytes(self, elements: int) -> int:
        """Bytes of the scale section for `elements` elements."""
        if not self.group_size:
            return 0
        return (elements // self.group_size) * self.scale_bytes_per_group

    def row_data_bytes(self, head_dim: int) -> int:
        return self.data_bytes(head_dim)

    def row_scale_bytes(self, head_dim: int) -> int:
        return self.scale_bytes(head_dim)

    def row_bytes(self, head_dim: int) -> int:
        return self.row_data_bytes(head_dim) + self.row_scale_bytes(head_dim)

    def block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes of one block (one layer, one side): data section then scale section."""
        self.check_head_dim(head_dim)
        elements = block_size * num_kv_heads * head_dim
        return self.data_bytes(elements) + self.scale_bytes(elements)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ConfigError if this codec cannot store vectors of `head_dim` elements."""
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, got {head_dim!r}")
        need = max(self.group_size, 16 if self.rotated else 1, 8 if self.code_bits < 8 else 1)
        if head_dim % need:
            raise ConfigError(
                f"codec {self.name!r} needs head_dim to be a multiple of {need}, got {head_dim}"
            )

    # ---- values ----------------------------------------------------------------------------
    def value_table(self) -> Optional[torch.Tensor]:
        """float32 [2**code_bits]: the value of each code before the group scale (None for raw
        bf16 / f16)."""
        from .tables import value_table

        return value_table(self)

    @property
    def traits(self):
        """What implementations switch on (decode kind, encode rule, scale, packing), derived
        from this row by `pagedkv.codecs.derive.traits`; ConfigError for a row it cannot describe."""
        from .derive import traits

        return traits(self)

    def __str__(self) -> str:
        return self.name
