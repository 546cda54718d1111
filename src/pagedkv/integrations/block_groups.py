"""Block groups of the transformers cache: the block ids a group of layers shares (reference
counts, a growable free list) and one block table per batch row; sliding-window groups release
the blocks no query can see any more. Plain Python bookkeeping; the pools live in the layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..errors import CacheFull


class BlockGroup:
    """One block group: the block ids its layers share (a growable free list with reference
    counts) and one block table (list of ids) per batch row. Plain Python; the pools live in the
    layers.

    window: None for the global (full-attention) layers; W for a group of sliding-window layers,
    whose rows release the blocks that no current or future query can see (`reclaim`): a
    released entry of a table is -1; the tensor the ops read keeps any id there (the old one, or
    0 after a rebuild): they never read a block wholly outside the window (the CPU and Triton
    kernels start at the window's first block; the reference gathers and masks it, and every
    block holds encodings of finite values or zeros, so p = 0 times a finite value stays 0).
    `dead[r]`: how many leading entries of row r's table are released.
    max_blocks: the most blocks the pools may grow to (None: unlimited).
    layers: the model layer indices whose pools this group addresses.
    """

    def __init__(self, block_size: int, num_blocks: int, max_blocks: Optional[int] = None, *,
                 window: Optional[int] = None, layers: Sequence[int] = ()):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.initial_blocks = num_blocks
        self.max_blocks = max_blocks
        self.window = window
        self.layers = list(layers)
        self.ref = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: list[list[int]] = []
        self.dead: list[int] = []
        self.version = 0  # bumps when any table changes (the slot memo is dropped)
        self.tensor: Optional[torch.Tensor] = None  # int32 [rows, width >= longest table], cpu
        self.rebuild = True  # the tensor is rebuilt from the tables on next use
        self.updates: list = []  # (row, index, ids) written into the tables since the tensor was made
        self.stamp = 0  # bumps when the tensor's content changes
        self.device_tensor: Optional[tuple] = None  # ((stamp, device name), tensor)
        self.slots_memo: Optional[tuple] = None  # (version, starts, counts, device name, slots)

    @property
    def name(self) -> str:
        return "global" if self.window is None else f"sliding-window (W={self.window})"

    def check(self, n: int, freed: int = 0) -> None:
        """Raise CacheFull unless n blocks can be had (`freed`: blocks a pending `reclaim` frees)."""
        free = len(self.free) + freed
        if n > free and self.max_blocks is not None and self.num_blocks + n - free > self.max_blocks:
            raise CacheFull(
                f"the paged cache's {self.name} layers need {n} more blocks of {self.block_size} "
                f"tokens but have {free} free of {self.num_blocks} (max_tokens allows "
                f"{self.max_blocks} blocks); raise max_tokens"
            )

    def reserve(self, n: int, grow) -> None:
        """Make sure n blocks are free, growing the pools (`grow(new_total)` resizes the group's
        layers first) or raising CacheFull before any change."""
        if n <= len(self.free):
            return
        self.check(n)
        need_total = self.num_blocks + n - len(self.free)
        new_total = max(2 * self.num_blocks, need_total)
        if self.max_blocks is not None:
            new_total = min(new_total, self.max_blocks)
        grow(new_total)
        self.ref += [0] * (new_total - self.num_blocks)
        self.free = list(range(new_total - 1, self.num_blocks - 1, -1)) + self.free
        self.num_blocks = new_total

    def take(self, n: int, grow) -> list[int]:
        self.reserve(n, grow)
        ids = [self.free.pop() for _ in range(n)]
        for b in ids:
            self.ref[b] = 1
        return ids

    def release(self, b: int) -> None:
        if b < 0:  # an entry already released by `reclaim`
            return
        self.ref[b] -= 1
        assert self.ref[b] >= 0
        if self.ref[b] == 0:
            self.free.append(b)

    def first_needed(self, length: int) -> int:
        """The first position a query at any position >= length can see (0 for global layers):
        a query at p sees keys j with p - W < j <= p."""
        return 0 if self.window is None else max(0, length - self.window + 1)

    def reclaimable(self, lengths: Sequence[int]) -> int:
        """How many blocks `reclaim(lengths)` would return to the free list (shared blocks count
        once every row holding them lets go)."""
        if self.window is None:
            return 0
        drops: dict = {}
        for r, n in enumerate(lengths):
            table = self.tables[r]
            for i in range(self.dead[r], min(self.first_needed(n) // self.block_size, len(table))):
                drops[table[i]] = drops.get(table[i], 0) + 1
        return sum(self.ref[b] == k for b, k in drops.items())

    def reclaim(self, lengths: Sequence[int]) -> None:
        """Release, per row r, the blocks wholly before `first_needed(lengths[r])` (sliding groups
        only). Called before a chunk is stored at positions lengths[r].., so the chunk's queries
        and every later one can still see all they need, and a crop back to `lengths` stays
        possible."""
        if self.window is None:
            return
        bs = self.block_size
        for r, n in enumerate(lengths):
            table = self.tables[r]
            upto = min(self.first_needed(n) // bs, len(table))
            if upto > self.dead[r]:
                for i in range(self.dead[r], upto):
                    self.release(table[i])
                    table[i] = -1
                self.dead[r] = upto
                self.version += 1

    def shrink_plan(self, need: int) -> Optional[tuple[int, list[int], list[int]]]:
        """When a sliding group uses at most a quarter of its blocks (after a long prefill chunk
        left the window), the smaller size its pools should take: (new_total, src, dst) with
        the in-use blocks src (ids >= new_total) to move to the free ids dst; None to keep the
        size. need: blocks about to be taken."""
        target = max(self.initial_blocks, 2 * (self.used + need))
        if self.window is None or 2 * target > self.num_blocks:
            return None
        src = [b for b in range(target, self.num_blocks) if self.ref[b]]
        dst = [b for b in range(target) if not self.ref[b]][: len(src)]
        return target, src, dst

    def shrink(self, target: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Renumber blocks src -> dst (the layers' pools were moved and cut first) and cut the
        group to `target` blocks."""
        moved = dict(zip(src, dst))
        for table in self.tables:
            for i, b in enumerate(table):
                if b in moved:
                    table[i] = moved[b]
        for a, b in moved.items():
            self.ref[b] = self.ref[a]
        self.ref = self.ref[:target]
        self.free = [b for b in range(target - 1, -1, -1) if not self.ref[b]]
        self.num_blocks = target
        self.changed()

    def changed(self, row: Optional[int] = None, index: int = 0, ids: Sequence[int] = ()) -> None:
        """Note a table change: entries index.. of `row` now hold ids (None: anything, the
        tensor is rebuilt). Released entries need no note: the ops never read them, so the
        tensor may keep the old id there."""
        self.version += 1
        if row is None:
            self.rebuild, self.updates = True, []
        elif not self.rebuild:
            self.updates.append((row, index, list(ids)))

    def table_tensor(self, device) -> torch.Tensor:
        """int32 [rows, width] (entries past a row's table and released entries read as any
        block id, 0 after a rebuild). Rebuilt after rows change; appended blocks are written in
        place (the width doubles when a table outgrows it), so a decode step costs O(new blocks)."""
        if self.rebuild or self.tensor is None:
            width = max((len(t) for t in self.tables), default=0)
            t = torch.zeros(len(self.tables), max(width, 1), dtype=torch.int32)
            for r, ids in enumerate(self.tables):
                if ids:
                    t[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            self.tensor = t.clamp_(min=0)
            self.rebuild, self.updates = False, []
            self.stamp += 1
        elif self.updates:
            t = self.tensor
            need = max(i + len(ids) for _, i, ids in self.updates)
            if need > t.shape[1]:
                wider = torch.zeros(t.shape[0], max(need, 2 * t.shape[1]), dtype=torch.int32)
                wider[:, : t.shape[1]] = t
                self.tensor = t = wider
            rows = [r for r, _, ids in self.updates for _ in ids]
            cols = [i + k for _, i, ids in self.updates for k in range(len(ids))]
            vals = [b for _, _, ids in self.updates for b in ids]
            t[rows, cols] = torch.tensor(vals, dtype=torch.int32)
            self.updates = []
            self.stamp += 1
        key = (self.stamp, str(device))
        if self.device_tensor is None or self.device_tensor[0] != key:
            self.device_tensor = (key, self.tensor.to(device))
        return self.device_tensor[1]

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)
