"""Block tables, slot mappings and the per-step batch description, as tensors for kernels.

`slot(pos) = block_table[pos // block_size] * block_size + pos % block_size`.
Block tables are int32 `[B, max_blocks]`, padded with 0 past a sequence's blocks (kernels read
only the first ceil(seq_len / block_size) entries of a row); slot mappings are int64 `[T]`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch

from ..errors import InvalidInput


class GroupSlots:
    """Per-layer access to slots of a cache with several block groups (one per sliding window,
    plus the recent window's tails): `group_slots[g]` int64 [T] are the new tokens' slots in
    group g, `layer_group[i]` the group of layer i, `tail_group` the tails' group (or None).
    With one group everything is `slot_mapping`."""

    def layer_slots(self, layer: int) -> torch.Tensor:
        """int64 [T]: the new tokens' slots in layer `layer`'s pages."""
        return _pick(self.group_slots, self.slot_mapping, self.layer_group, layer)

    @property
    def tail_slots(self) -> Optional[torch.Tensor]:
        """int64 [T]: the new tokens' slots in the recent window's tails (None without one)."""
        return _pick(self.group_slots, self.slot_mapping, None, self.tail_group)


def _pick(per_group: tuple, whole, layer_group: Optional[tuple], index: Optional[int]):
    """The entry of one group: `per_group[g]` (g = layer_group[index], or index itself when
    layer_group is None), `whole` when the cache has one group, None when index is None."""
    if index is None:
        return None
    if not per_group:
        return whole
    return per_group[index if layer_group is None else layer_group[index]]


@dataclass(frozen=True)
class StepBatch(GroupSlots):
    """What one forward step's ops need (see `PagedCache.step`).

    slot_mapping: int64 [T], the new tokens' slots, sequences in batch order (in the first block
    group: every layer's with one group). block_tables: int32 [B, max_blocks] (first group);
    seq_lens: int32 [B], tokens held including the new ones; query_start_loc: int32 [B+1],
    offsets of each sequence's new tokens in the T axis. With several groups: `group_slots` /
    `group_tables` per group, `layer_slots(i)` / `layer_tables(i)` per layer (see GroupSlots).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    group_slots: tuple = ()
    group_tables: tuple = ()
    layer_group: tuple = ()
    tail_group: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def layer_tables(self, layer: int) -> torch.Tensor:
        """int32 [B, max_blocks]: block tables of layer `layer`'s pages."""
        return _pick(self.group_tables, self.block_tables, self.layer_group, layer)

    @property
    def tail_tables(self) -> Optional[torch.Tensor]:
        """int32 [B, max_blocks]: block tables of the recent window's tails (None without)."""
        return _pick(self.group_tables, self.block_tables, None, self.tail_group)


def block_table_tensor(tables: Sequence[array], device: torch.device) -> torch.Tensor:
    """int32 [B, max(1, longest table)] from per-sequence `array('i')` tables, 0-padded.

    Rows are copied as raw bytes into one buffer (no per-element Python work)."""
    width = max((len(t) for t in tables), default=0) or 1
    row = width * 4
    buf = bytearray(len(tables) * row)
    for r, t in enumerate(tables):
        buf[r * row:r * row + len(t) * 4] = t
    out = torch.frombuffer(buf, dtype=torch.int32).view(len(tables), width) if tables else \
        torch.zeros(0, width, dtype=torch.int32)
    return out if device.type == "cpu" else out.to(device)


def int_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor from Python ints, built on the CPU then moved (one transfer)."""
    if dtype == torch.int64:
        a = array("q", values)
    else:
        a = array("i", values)
    t = torch.frombuffer(bytearray(a), dtype=dtype) if len(a) else torch.zeros(0, dtype=dtype)
    return t if device.type == "cpu" else t.to(device)


def slots_from_block_table(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """Slots of token positions through block tables (vectorized, any device).

    block_tables: int32/int64 [max_blocks] (one sequence) or [B, max_blocks];
    positions: int64 [T]; rows: int64 [T], the batch row of each position (2-D tables only).
    Returns int64 [T]: `table[pos // block_size] * block_size + pos % block_size`.
    """
    if positions.numel() and int(positions.min()) < 0:
        raise InvalidInput("positions must be >= 0")
    pos = positions.long()
    idx = pos // block_size
    if block_tables.dim() == 1:
        if idx.numel() and int(idx.max()) >= block_tables.shape[0]:
            raise InvalidInput(
                f"position {int(pos.max())} needs block {int(idx.max())}, the table has "
                f"{block_tables.shape[0]}"
            )
        blocks = block_tables.long()[idx]
    elif block_tables.dim() == 2:
        if rows is None or rows.shape != positions.shape:
            raise InvalidInput("2-D block tables need `rows`, int64 [T] like positions")
        if idx.numel() and int(idx.max()) >= block_tables.shape[1]:
            raise InvalidInput(
                f"position {int(pos.max())} needs block {int(idx.max())}, the tables have "
                f"{block_tables.shape[1]} columns"
            )
        blocks = block_tables.long()[rows.long(), idx]
    else:
        raise InvalidInput(f"block_tables must be 1-D or 2-D, got shape {list(block_tables.shape)}")
    return blocks * block_size + pos % block_size


@dataclass(frozen=True)
class NewSequence(GroupSlots):
    """Result of `add_sequence`: the id, how many leading tokens were prefix hits (already stored
    and committed), and int64 [len(tokens) - hit_tokens] slots for the rest (`slot_mapping`: the
    first block group's; `layer_slots(i)` / `tail_slots` per layer with several groups)."""

    seq_id: Hashable
    hit_tokens: int
    slot_mapping: torch.Tensor
    group_slots: tuple = ()
    layer_group: tuple = ()
    tail_group: Optional[int] = None
