"""The batch rows of a transformers drop-in as sequences of its engine cache.

transformers' Cache contract speaks of batch rows and columns (pads included); the engine cache
(`pagedkv.cache.PagedCache`, the one data plane) of sequences and tokens. `BatchRows` is the map
between them, used (composed, not inherited) by both drop-ins: row r is engine sequence
`ids[r]`; `columns` (`padding.ColumnMap`) says which columns each row stored; the first layer of
a chunk to store asks `step` for the engine's step of every block group (the previous step is
committed first), the other layers of the chunk find it here; `begin` admits prompts with the
engine's prefix hits, `rearrange` is fork then free, `crop` is pop (all rows checked first);
`store` and `attend` are a layer's chunk through the engine, pads left out (`padding.pack`).
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import torch

from ..errors import InvalidInput
from .padding import ColumnMap, pack, unpack


class BatchRows:
    """The rows of one drop-in over `engine` (see the module doc). `next_ids`: the running
    forward's input_ids (set by the model's forward pre-hook), so blocks are keyed by token ids."""

    def __init__(self, engine):
        self.engine = engine
        self.ids: list = []
        self.columns = ColumnMap()
        self.next_ids: Optional[torch.Tensor] = None
        self._sids = itertools.count()
        self._plan: Optional[tuple] = None  # ((starts, counts), StepBatch) of the chunk being stored
        self._uncommitted = False

    def __len__(self) -> int:
        return len(self.ids)

    def lengths(self, columns: int) -> list[int]:
        """Tokens each row stored in its first `columns` columns."""
        return self.columns.row_lengths(columns, len(self.ids))

    def ensure(self, batch: int) -> None:
        """Empty rows for a batch of `batch` (InvalidInput when the rows are another batch's)."""
        if not self.ids:
            self.ids = [self.engine.add_sequence([], seq_id=next(self._sids), load=False).seq_id
                        for _ in range(batch)]
            self._plan = None
        elif batch != len(self.ids):
            raise InvalidInput(
                f"batch size {batch} differs from the cache's {len(self.ids)} rows; "
                "use a fresh PagedKVCache per batch (or batch_select_indices)"
            )

    def commit(self) -> None:
        """Every layer stored the last step: its tokens are committed (full blocks with known
        token ids become prefix hits; the tiers publish and cap)."""
        if self._uncommitted:
            self._uncommitted = False
            self.engine.commit(self.ids)

    def step(self, starts: Sequence[int], counts: Sequence[int], valid: Optional[torch.Tensor] = None):
        """The engine's `StepBatch` for the next counts[r] tokens of each row r (stored after its
        starts[r] tokens; valid: the chunk's bool [B, T] columns, None = all)."""
        key = (tuple(starts), tuple(counts))
        if self._plan is None or self._plan[0] != key:
            self.commit()
            self._plan = (key, self.engine.step(self.ids, self._step_tokens(counts, valid)))
            self._uncommitted = True
        return self._plan[1]

    def store(self, start: int, valid: Optional[torch.Tensor], batch: int, width: int, write) -> None:
        """Store a chunk of `width` columns from column `start` (valid: bool [batch, width], None
        = all): when some token is valid, `write(counts, step)` with each row's valid count and
        a function giving the engine's StepBatch for them; then the columns are noted."""
        counts = [width] * batch if valid is None else valid.sum(dim=1).tolist()
        if sum(counts):
            write(counts, lambda: self.step(self.lengths(start), counts, valid))
        self.columns.record(start, valid, batch, width)

    @staticmethod
    def attend(queries: tuple, valid: Optional[torch.Tensor], decode, prefill) -> torch.Tensor:
        """Each row's valid queries (queries: tensors [B, T, ...], valid bool [B, T] or None) attend
        through the engine: `decode(*packed)` when every row runs one query (None: never),
        else `prefill(*packed, query_start_loc)`; None for both when nothing is stored yet.
        Returns [B, T, ...] float32 with zeros at the pad queries (transformers drops them)."""
        b, t = queries[0].shape[:2]
        packed = [pack(q, valid).contiguous() for q in queries]
        if prefill is None or packed[0].shape[0] == 0:  # nothing stored yet, or every query a pad
            out = torch.zeros(packed[0].shape, dtype=torch.float32, device=packed[0].device)
        elif decode is not None and t == 1 and valid is None:
            out = decode(*packed)
        else:
            dev = packed[0].device
            qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * t
            if valid is not None:
                qsl = torch.zeros(b + 1, dtype=torch.int32, device=dev)
                qsl[1:] = torch.cumsum(valid.sum(dim=1).to(dev), 0)
            out = prefill(*packed, qsl)
        return unpack(out, valid, b, t)

    def _step_tokens(self, counts: Sequence[int], valid: Optional[torch.Tensor]) -> list:
        """Per row the token ids of the chunk (from the forward's input_ids, valid columns
        only) or, when they are unknown, the count (such blocks are never prefix keys)."""
        ids, self.next_ids = self.next_ids, None
        if ids is None or ids.dim() != 2 or ids.shape[0] != len(counts):
            return list(counts)
        rows = ids.detach().cpu().tolist() if valid is None else \
            [r.tolist() for r in ids.detach().cpu()[valid.cpu()].split(list(counts))]
        if [len(r) for r in rows] != list(counts):
            return list(counts)
        return rows

    def begin(self, prompts: list[list[int]], reuse: bool) -> int:
        """Drop the rows (their committed full blocks stay cached), then admit `prompts` with the
        longest hit every one of them takes, brought up from a prefix store first (none with
        reuse False, or while some layer's transform is not fixed). Returns the hit in blocks."""
        self.commit()
        for sid in self.ids:
            self.engine.free(sid)
        self.ids, self._plan = [], None
        if reuse:
            for p in prompts:
                self.engine.load_prefix(p)  # adopts the store's transform first when it may
        fixed = len(self.engine.fitted) == len(self.engine.layers)
        hit = self.engine.core.common_hit(prompts) if reuse and fixed else 0
        self.ids = [self.engine.add_sequence(p, seq_id=next(self._sids), max_hit_blocks=hit,
                                             rest=False, load=False).seq_id for p in prompts]
        self.columns.clear()
        return hit

    def rearrange(self, sources: Sequence[int]) -> None:
        """New row i = old row sources[i]: forks share the blocks (one reference count per
        holder, a shared partial block is copied when next written), then the old rows go."""
        self.commit()
        self.columns.select(sources)
        new = [self.engine.fork(self.ids[s], next(self._sids)) for s in sources]
        for sid in self.ids:
            self.engine.free(sid)
        self.ids, self._plan = new, None

    def crop_limit(self) -> int:
        """The fewest columns a crop can keep besides 0: each group's sequences refuse a pop
        below `min_length` (released sliding-window blocks must stay unseen)."""
        return max((self.columns.columns_at(r, g.min_length(sid)) for g in self.engine.core.groups
                    for r, sid in enumerate(self.ids) if g.min_length(sid)), default=0)

    def crop(self, keep: int, columns: int) -> None:
        """Keep the first `keep` columns, then each row's tokens of its first `columns` columns
        (the engine pops the rest, reading a swapped new last block back); every row is checked
        before any changes (InvalidInput naming the smallest crop)."""
        lengths = self.lengths(keep)
        for g in self.engine.core.groups:
            for r, sid in enumerate(self.ids):
                if lengths[r] and lengths[r] < g.min_length(sid):
                    raise InvalidInput(
                        f"cannot crop to {keep} columns: row {r} would keep {lengths[r]} tokens and "
                        f"its sliding-window layers (window {g.window}) need positions from "
                        f"{g.first_needed(lengths[r])}, but released those before "
                        f"{g.dead(sid) * g.block_size}; the smallest crop kept is "
                        f"{self.crop_limit()} columns (or 0)")
        self.columns.keep(keep)
        for sid, n in zip(self.ids, self.lengths(columns)):
            cur = self.engine.seq_len(sid)
            if cur > n:
                self.engine.pop(sid, cur - n)
        self._plan = None

    def reset(self) -> None:
        """Drop every row, every stored prefix and every layer's transform."""
        self.engine.clear()
        self.engine.reset_transforms()
        self.ids, self._plan, self._uncommitted = [], None, False
        self.columns.clear()
