"""Which slots a store of the engine cache may write (issue 12 item 9).

A slot is writable while it is *pending*: handed out by `add_sequence` / `allocate` / `step` and
not yet committed, popped or freed. Two things are refused before any byte is written:
- a slot below what its sequence committed, e.g. another live sequence's partly filled last
  block (its offsets are "allocated", so the plain slot check let them through);
- a stale slot tensor: one the cache handed out for sequences that were committed, popped or
  freed since (after free + reuse its slots may belong to another sequence's new tokens), or
  whose block group moved blocks since (a sliding group's compaction renumbers them).

`Handouts` remembers every slot tensor it handed out (by identity, weakly, with its
`_version`), the generation of each of its sequences and each group's move count at that time.
A tensor it did not hand out (built by the caller, sliced, `slot_mapping(...)`) is accepted
only if every slot is pending now (`pending` mask of the group, rebuilt once per change).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Callable, Hashable, Iterable, Sequence

import torch

from ..errors import InvalidInput


class Handouts:
    """Generations of sequences and handed-out slot tensors of one cache (see module doc)."""

    def __init__(self, num_groups: int):
        self._gen: dict = {}  # seq id -> generation (bumps at commit / pop; gone at free)
        self._next = itertools.count(1)
        self._tensors: dict[int, tuple] = {}  # id(tensor) -> (weakref, _version, record)
        self.moves = [0] * num_groups
        self.epoch = 0  # bumps at every change of what is pending
        self._pending: dict = {}  # group -> (epoch, bool mask [slots])

    # ---- state changes ------------------------------------------------------------------------
    def changed(self, seq_ids: Iterable[Hashable]) -> None:
        """The sequences were added, committed or popped: earlier handouts of them go stale."""
        for s in seq_ids:
            self._gen[s] = next(self._next)
        self.epoch += 1

    def gone(self, seq_ids: Iterable[Hashable]) -> None:
        for s in seq_ids:
            self._gen.pop(s, None)
        self.epoch += 1

    def clear(self) -> None:
        self._gen.clear()
        self.epoch += 1

    def group_moved(self, group: int) -> None:
        self.moves[group] += 1
        self.epoch += 1

    def record(self, tensors: Sequence[torch.Tensor], seq_ids: Sequence[Hashable]) -> None:
        """Remember slot tensors just handed out for `seq_ids`."""
        rec = (tuple((s, self._gen.get(s)) for s in seq_ids), tuple(self.moves))
        for t in tensors:
            key = id(t)
            self._tensors[key] = (weakref.ref(t, lambda _, k=key, d=self._tensors: d.pop(k, None)),
                                  version(t), rec)
        self.epoch += 1

    # ---- the check ----------------------------------------------------------------------------
    def check(self, slots: torch.Tensor, used: torch.Tensor, group: int,
              pending: Callable[[], torch.Tensor]) -> None:
        """InvalidInput unless `slots` (used: its slots >= 0, on the CPU) may be written in
        `group`; `pending()` builds the group's bool mask of pending slots."""
        entry = self._tensors.get(id(slots))
        if entry is not None and entry[0]() is slots and entry[1] is not None \
                and entry[1] == version(slots):
            seqs, moves = entry[2]
            for s, gen in seqs:
                if self._gen.get(s) != gen:
                    what = "freed" if s not in self._gen else "committed or popped"
                    raise InvalidInput(
                        f"these slots were handed out for sequence {s!r}, which was {what} since; "
                        "store a step's K/V before its commit, with the slots of that step")
            if moves[group] != self.moves[group]:
                raise InvalidInput("these slots were handed out before the layer's sliding-window "
                                   "group moved its blocks (compaction); use the latest step's slots")
            return
        key = (self.epoch, group)
        memo = self._pending.get(group)
        if memo is None or memo[0] != key:
            memo = (key, pending())
            self._pending[group] = memo
        ok = memo[1][used]
        if not bool(ok.all()):
            i = int((~ok).nonzero()[0, 0])
            raise InvalidInput(
                f"slot {int(used[i])} is not pending: it holds K/V a sequence already committed "
                "(or it belongs to no sequence's new tokens); store only at the slots of the "
                "latest add_sequence / allocate / step, before commit")


def version(t: torch.Tensor):
    """The tensor's version counter, or None for an inference tensor (made under
    `torch.inference_mode`, which keeps none: such a tensor is never taken as unmodified)."""
    return None if t.is_inference() else t._version


def pending_mask(seqs, num_slots: int) -> torch.Tensor:
    """bool [num_slots]: slots of every sequence's positions [committed, length) in one block
    group (`alloc.SequenceManager`), the slots a store may write."""
    mask = torch.zeros(num_slots, dtype=torch.bool)
    bs = seqs.block_size
    idx = []
    for sid in seqs.ids():
        t = seqs.table(sid)
        idx.extend(t[p // bs] * bs + p % bs for p in range(seqs.committed(sid), seqs.length(sid))
                   if t[p // bs] >= 0)
    if idx:
        mask[torch.tensor(idx, dtype=torch.long)] = True
    return mask
