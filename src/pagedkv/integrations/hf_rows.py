"""The rows of the transformers drop-in on the block manager: a batch row is a sequence of
`pagedkv.alloc.BlockManager`; the first layer of a forward to store asks it for the step of
every block group (`StepPlan`: all or nothing, CacheFull before any change) and applies the plan
to every layer's pools; `begin` starts a batch with prefix hits; beam reorders fork and free;
crops pop. Mixed into `PagedKVCache`.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence, Union

import torch

from ..alloc.manager import BlockManager, GroupSpec, GroupStep
from ..cache.tables import block_table_tensor, int_tensor
from ..errors import InvalidInput
from ..cache.groups import group_layout
from .hf_common import _UNBOUNDED, GroupView


class RowStorage:
    """Storage methods of `PagedKVCache` (see the module doc)."""

    # ---- storage shared by the layers ---------------------------------------------------------
    def _make_groups(self, block_size: int, max_tokens: Optional[int]) -> None:
        """One block group per distinct sliding window (None = the global layers), each with its
        own block ids, tables and pools, all managed by one `pagedkv.alloc.BlockManager` (rows
        are its sequences); the layout is the engine cache's (`cache.groups.group_layout` of
        `self.config`: `reclaim_sliding=False` puts every layer in one group, nothing released,
        any crop works; a recent window's tails live in the group of window R, `tail_group`).
        `self.blocks` is the global group (the first sliding group when every layer slides).
        With max_tokens every group may hold at most ceil(max_tokens / block_size) blocks: the
        global group is allocated at that size, a sliding group starts small and grows on demand
        (it holds at most what the global group holds, usually far less: each row's last W
        tokens plus the chunk being stored)."""
        cap = -(-max_tokens // block_size) if max_tokens else None
        layout = group_layout(self.config)
        specs = []
        for w, k in zip(layout.windows, layout.keep_first):
            initial = cap if (cap is not None and w is None) else min(cap or 16, 16)
            specs.append(GroupSpec(w, initial, cap if cap is not None else _UNBOUNDED, k))
        self.core = BlockManager(specs, block_size, self.config.fingerprint)
        self.groups = [GroupView(self, i, w, [j for kind, j in m if kind == "main"],
                                 [j for kind, j in m if kind == "tail"])
                       for i, (w, m) in enumerate(zip(layout.windows, layout.members))]
        self.blocks = self.groups[0]
        self.tail_group = None if layout.tail_group is None else self.groups[layout.tail_group]
        self._group_of = {i: g for g in self.groups for i in g.layers}
        self._rows: list[int] = []
        self._sids = itertools.count()
        self._plan: Optional[tuple] = None  # (key, StepPlan, {(group, device): slots})
        self._uncommitted = False
        self._tables: dict = {}  # (group, device) -> int32 tables of the current step
        self._next_ids: Optional[torch.Tensor] = None  # input_ids of the running forward
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    @property
    def batch_rows(self) -> int:
        return len(self._rows)

    def _ensure_rows(self, batch: int) -> None:
        if not self._rows:
            for _ in range(batch):
                sid = next(self._sids)
                self.core.add(sid, [], rest=True)
                self._rows.append(sid)
            self._changed()
        elif batch != len(self._rows):
            raise InvalidInput(
                f"batch size {batch} differs from the cache's {len(self._rows)} rows; "
                "use a fresh PagedKVCache per batch (or batch_select_indices)"
            )

    def _changed(self) -> None:
        """Rows or tables changed outside a step: the next chunk plans afresh."""
        self._plan = None
        self._tables = {}

    def _commit(self) -> None:
        """Every layer stored the last step: its tokens are committed (full blocks with known
        token ids become prefix hits for later sequences)."""
        if self._uncommitted:
            self.core.commit(self._rows)
            self._uncommitted = False
            if self.tiers is not None:
                self.tiers.after_commit()

    def _rows_changed(self) -> None:
        self._changed()
        if self.tiers is not None:
            self.tiers.drop_dead()

    def _apply_sizes(self) -> None:
        """Resize pools to their groups' block counts (after growth outside a step)."""
        for view in self.groups:
            n = view.num_blocks
            members = [self.layers[i].paged for i in view.layers] + \
                [self.layers[i].tail for i in view.tails]
            if any(p is not None and p.num_blocks != n for p in members):
                self._apply_step(view, GroupStep((), n, (), ()))

    def _apply_step(self, view: "GroupView", step: GroupStep) -> None:
        """One group's plan step applied to its members: pages of its layers, tails it holds."""
        for i in view.layers:
            self.layers[i]._apply(step)
        for i in view.tails:
            self.layers[i]._apply_tail(step)

    def attention_inputs(self, layer, device, tail: bool = False):
        """(PagedLayer, int32 block tables [rows, width]) the layer (tail=True: its recent
        window's tail) attends through (swapped blocks read back when the tiers swapped some)."""
        if self.tiers is not None:
            return self.tiers.attention(layer, device, tail)
        if tail:
            return layer.tail, self.block_table_tensor(device, self.tail_group)
        return layer.paged, self.block_table_tensor(device, layer.group)

    def offload_stats(self) -> dict:
        """Swapped blocks now, and the swap and prefix tiers' counters."""
        if self.tiers is None:
            return {"swapped_blocks": 0}
        return self.tiers.stats(self._rows)

    def close(self) -> None:
        """Delete this cache's swap records and close its tiers."""
        if self.tiers is not None:
            self.tiers.close()

    def _slots(self, start: int, count: int, device) -> torch.Tensor:
        """Slots for positions start..start+count of every row (row-major) in the global group.
        int64 [rows * count]."""
        return self._slots_rows([start] * self.batch_rows, [count] * self.batch_rows, device)

    def _slots_rows(self, starts: Sequence[int], counts: Sequence[int], device,
                    group: Optional["GroupView"] = None, valid: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
        """Slots (in `group`, default the global one) for the next counts[r] tokens of each row
        r (stored after its starts[r] tokens), row-major. The first layer of a forward to store
        asks the block manager for the step of every group at once (window reclaim, growth,
        compaction, copy-on-write: all or nothing, CacheFull before any change) and applies its
        plan to every layer's pools; the other layers find it here. int64 [sum(counts)]."""
        g = self.blocks if group is None else group
        key = (tuple(starts), tuple(counts))
        if self._plan is None or self._plan[0] != key:
            self._commit()
            plan = self.core.step(self._rows, self._step_tokens(counts, valid))
            for view, gs in zip(self.groups, plan.groups):
                self._apply_step(view, gs)
            if self.tiers is not None:  # the window reclaim may have dropped swapped entries
                self.tiers.drop_dead()
            self._plan = (key, plan, {})
            self._tables = {}
            self._uncommitted = True
        memo = self._plan[2]
        slots = memo.get((g.index, str(device)))
        if slots is None:
            slots = int_tensor(self._plan[1].groups[g.index].slots, torch.int64, device)
            memo[(g.index, str(device))] = slots
        return slots

    def _step_tokens(self, counts: Sequence[int], valid: Optional[torch.Tensor]) -> list:
        """Per row the token ids of the chunk (from the forward's input_ids, valid columns
        only) or, when they are unknown, the count (such blocks are never prefix keys)."""
        ids, self._next_ids = self._next_ids, None
        if ids is None or ids.dim() != 2 or ids.shape[0] != len(counts):
            return list(counts)
        rows = ids.detach().cpu().tolist() if valid is None else \
            [r.tolist() for r in ids.detach().cpu()[valid.cpu()].split(list(counts))]
        if [len(r) for r in rows] != list(counts):
            return list(counts)
        return rows

    def begin(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
              reuse: bool = True) -> int:
        """Start a new batch reusing this cache's stored prefixes: call before
        `model.generate(input_ids, past_key_values=cache)` (or `cache=cache`). The previous rows
        are dropped (their committed full blocks stay cached); each new row takes the longest
        run of whole blocks its prompt shares with what the cache stored before (the same run
        for every row, always leaving one token to compute, none for padded rows or when some
        layers slide). Returns the hit tokens: `generate` then computes only the rest.
        input_ids int [B, T]; attention_mask [B, T] or None; reuse=False starts the batch
        without prefix hits (the layers keep their statistics)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InvalidInput(f"begin needs input_ids int [batch, tokens], got "
                               f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        self._flush()
        self._commit()
        rows = input_ids.detach().cpu().tolist()
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        for sid in self._rows:
            self.core.free(sid)
        self._rows = []
        self._rows_changed()
        if self.tiers is not None and reuse and not padded:
            self.tiers.before_begin(rows)
        hit = 0 if padded or not reuse or not all(layer.is_initialized for layer in self.layers) \
            else self.core.common_hit(rows)
        for r in rows:
            sid = next(self._sids)
            self.core.add(sid, r, rest=False, max_hit_blocks=hit)
            self._rows.append(sid)
        for layer in self.layers:
            layer.length = hit * self.config.block_size
            layer.pending = None
        self._valid, self._lens_memo = None, None
        self._valid_version += 1
        self._changed()
        self.prefix_hit_tokens += hit * self.config.block_size * len(rows)
        self.prefix_query_tokens += sum(len(r) for r in rows)
        return hit * self.config.block_size

    def block_table_tensor(self, device, group: Optional["GroupView"] = None) -> torch.Tensor:
        """int32 [rows, max_blocks] of `group` (default: the global one): entries past a row's
        table and released entries read as block 0, which the ops never read."""
        g = self.blocks if group is None else group
        key = (g.index, str(device))
        t = self._tables.get(key)
        if t is None:
            seqs = self.core.groups[g.index]
            t = block_table_tensor([seqs.table(s) for s in self._rows], torch.device("cpu"))
            t = t.clamp(min=0).to(device)
            self._tables[key] = t
        return t

    def _flush(self) -> None:
        for layer in self.layers:
            layer.flush()

    def _rearrange_rows(self, sources: Sequence[int]) -> None:
        """New row i = old row sources[i] (fork, then the old rows are freed): blocks are
        shared (one reference count per holder), a shared partial block is copied when it is
        next written."""
        self._flush()
        self._commit()
        if self._valid is not None:
            self._valid = self._valid[torch.tensor(list(sources), dtype=torch.long)]
            self._lens_memo = None
            self._valid_version += 1
        new = [self.core.fork(self._rows[s], next(self._sids)) for s in sources]
        for sid in self._rows:
            self.core.free(sid)
        self._rows = new
        self._rows_changed()

    def _truncate(self, length: Union[int, Sequence[int]]) -> None:
        """Drop each row's tokens past `length` (one int for every row, or one per row)."""
        lengths = [length] * self.batch_rows if isinstance(length, int) else list(length)
        for sid, n in zip(self._rows, lengths):
            cur = self.core.length(sid)
            if cur > n:
                rids = self.core.check_pop(sid, cur - n)
                # a new last block that was swapped out (in any group) is read back: fetched
                # before the pop changes anything, written into the block the pop brought back
                sections = None if all(r is None for r in rids) else self.tiers.pop_fetch(rids)
                backs = self.core.pop(sid, cur - n)
                self._apply_sizes()
                if sections is not None:
                    self.tiers.pop_restore(backs, sections)
        self._rows_changed()
