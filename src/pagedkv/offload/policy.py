"""Offload policies the cache core calls: the resident cap (swap) and the prefix tier.

They work on one block group of `pagedkv.alloc` (its `SequenceManager`, where a swapped block is
a table-entry state with ordinary reference counts) and on the group's layers as the ops see
them (`PagedLayer`); they never see the cache, the model or the evaluation code.

- `SwapPolicy.enforce(seqs, seq_id, layers)`: after a commit, swap the sequence's oldest full
  committed blocks out until at most `cap` stay resident (records written first, then the
  entries change: a failed write changes nothing). `view(...)`: the layer a batch attends to,
  its pools holding the resident blocks then the swapped ones read back (same bytes: attention
  is bit-identical); `fetch(...)`: a record's bytes, read back before a pop into the swapped
  region changes anything (the front door writes them into the block the pop brought back).
- `PrefixPolicy.fetch(layers, chains)`: a group's stored blocks, for the block manager's
  `load_prefix` (which writes them into the pool as cached prefix blocks, where the admission
  finds them); `publish(seqs, seq_id, layers)`: store the newly full committed blocks.
- `CoreTiers` (`offload/coretiers.py`): both, for every block group of a block manager.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import uuid
import weakref
from pathlib import Path
from typing import Hashable, Optional, Sequence

import torch

from ..alloc.sequences import SequenceManager, swapped_record
from ..ops.batch import PagedLayer
from .config import OffloadConfig
from .prefix import PrefixStore
from .store import open_prefix_store
from .record import BlockLayout
from .swap import SwapSpace
from .swapfile import GroupedSwapFiles, SwapFileTier
from .tiers import MemoryTier, SwapLost, Tier


_HOST = re.sub(r"[^0-9A-Za-z_.]", "_", socket.gethostname())[:40] or "host"


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_stale_swap_dirs(root: Path) -> int:
    """Delete swap directories (`<host>-<pid>-<id>`) that processes of this host left behind
    when they died without closing their cache. Returns how many were removed."""
    n = 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    for d in entries:
        parts = d.name.rsplit("-", 2)
        if len(parts) != 3 or parts[0] != _HOST or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # someone else's live process (or a bogus pid)
        _rmtree(str(d))
        n += 1
    return n


def build_tiers(owner, config, offload: OffloadConfig, swap_tier: Optional[Tier] = None,
                prefix_tier: Optional[Tier] = None, groups: int = 1):
    """(SwapSpace or None, PrefixStore or None, close()) for `offload`: the swap space when a
    resident cap is set (a private directory per cache, removed by close() or when `owner` is
    collected), the prefix store when one is configured (`store.open_prefix_store`: ConfigError
    without a model identity in `config`, or on Redis without a secret). Given tiers replace
    configured ones. groups: the cache's block groups (a swap file per group on disk: their
    records differ in size)."""
    prefix = open_prefix_store(config, offload, prefix_tier)
    swap = None
    finalizer = None
    if offload.resident_blocks_per_seq is not None:
        if swap_tier is None:
            if offload.swap == "memory":
                swap_tier = MemoryTier(offload.swap_limit_bytes)
            else:
                root = offload.swap_path()
                remove_stale_swap_dirs(root)
                d = root / f"{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
                swap_tier = SwapFileTier(d, offload.swap_limit_bytes) if groups == 1 else \
                    GroupedSwapFiles(d, offload.swap_limit_bytes, groups)
                finalizer = weakref.finalize(owner, _rmtree, str(d))
        swap = SwapSpace(swap_tier, prefetch=offload.prefetch)

    def close() -> None:
        if swap is not None:
            swap.close()
        if prefix is not None:
            prefix.tier.close()
        if finalizer is not None:
            finalizer()

    return swap, prefix, close


class _Layouts:
    """The record layout of a tuple of layers (recomputed when a layer's pools or transform
    change: `configure_layer`, growth, calibration)."""

    def __init__(self) -> None:
        self._for: tuple = ()
        self._layout: Optional[BlockLayout] = None

    def of(self, layers: Sequence[PagedLayer]) -> BlockLayout:
        key = tuple(getattr(pl, f) for pl in layers for f in _LAYOUT_FIELDS)
        if len(key) != len(self._for) or any(a is not b for a, b in zip(key, self._for)):
            self._layout, self._for = BlockLayout.from_layers(layers), key
        return self._layout  # type: ignore[return-value]


_LAYOUT_FIELDS = ("k_pool", "k_centre", "k_mult", "v_centre", "k_scale", "v_scale")


class SwapPolicy:
    """Per-sequence resident cap over one block group (`group`: its index, in the record keys),
    records in `swap` (a private tier shared by the groups)."""

    def __init__(self, swap: SwapSpace, cap: int, group: int = 0):
        self.swap, self.cap, self.group = swap, cap, group
        self.layouts = _Layouts()

    def key(self, rid: int) -> str:
        return self.swap.key_of(rid, self.group)

    def enforce(self, seqs: SequenceManager, seq_id: Hashable, layers: Sequence[PagedLayer]) -> int:
        """Swap out down to the cap; returns how many entries moved (TierWriteError from a
        write leaves that block and the later ones resident)."""
        todo = seqs.swap_candidates(seq_id, self.cap)
        if not todo:
            return 0
        layout = self.layouts.of(layers)
        done = []
        try:
            for i, b, rid, new in todo:
                if new:
                    self.swap.write(layers, layout, b, rid, self.group)
                done.append((i, b, rid, new))
        finally:
            seqs.swapped_out(seq_id, done)
        return len(done)

    def drop_dead(self, seqs: SequenceManager) -> None:
        """Delete the records no table entry names any more."""
        for rid in seqs.drain_dead_records():
            self.swap.release(self.key(rid))

    def fetch(self, seqs: SequenceManager, rid: int, layers: Sequence[PagedLayer]):
        """Every layer's bytes of record `rid` (SwapLost naming the sequences if not intact)."""
        try:
            return self.swap.read_whole(self.layouts.of(layers), self.key(rid))
        except SwapLost as exc:
            raise self.lost(seqs, exc, None) from None

    def lost(self, seqs: SequenceManager, exc: SwapLost, layer: Optional[int]) -> SwapLost:
        """The SwapLost a caller sees: the sequences and token ranges whose K/V is gone."""
        lost = set(exc.keys)
        bs = seqs.block_size
        hit = []
        for sid in seqs.ids():
            idx = [i for i in seqs.swapped(sid)
                   if self.key(swapped_record(seqs.table(sid)[i])) in lost]
            if idx:
                spans = ", ".join(f"{i * bs}..{(i + 1) * bs - 1}" for i in idx)
                hit.append(f"sequence {sid!r} (tokens {spans})")
        where = "" if layer is None else f" of layer {layer}"
        return SwapLost(f"K/V{where} swapped out to {self.swap.tier.name} cannot be read back "
                        f"intact (removed or corrupted outside pagedkv) for "
                        f"{'; '.join(hit) or 'no live sequence'}: free and recompute them",
                        keys=exc.keys)

    def plan(self, seqs: SequenceManager, seq_ids: Sequence[Hashable], device):
        """(resident block ids int64 [n], record keys, block tables int32 [B, width]) of a batch
        with swapped entries (tables index the view's pools, 0-padded), or None when nothing
        is swapped."""
        res: dict[int, int] = {}
        recs: dict[str, int] = {}
        rows = []
        for s in seq_ids:
            row = []
            for e in seqs.table(s):
                rid = swapped_record(e)
                if rid is None:
                    row.append(res.setdefault(max(e, 0), len(res)))
                else:
                    row.append(~recs.setdefault(self.key(rid), len(recs)))
            rows.append(row)
        if not recs:
            return None
        n_res = len(res)
        width = max(1, max(len(r) for r in rows))
        tables = torch.tensor([[j if j >= 0 else n_res + ~j for j in r] + [0] * (width - len(r))
                               for r in rows], dtype=torch.int32)
        return (torch.tensor(list(res), dtype=torch.int64, device=device), tuple(recs),
                tables.to(device))

    def view(self, pl: PagedLayer, index: int, layers: Sequence[PagedLayer], plan,
             seqs: Optional[SequenceManager] = None) -> PagedLayer:
        """Layer `pl` (position `index` in the group's `layers`) with temporary pools: the plan's
        resident blocks, then its swapped records' sections read back (SwapLost naming the
        sequences of `seqs` if one is not intact)."""
        resident, keys, _ = plan
        try:
            got = self.swap.read_layer(self.layouts.of(layers), index, keys)
        except SwapLost as exc:
            if seqs is None:
                raise
            raise self.lost(seqs, exc, index) from None
        n_res, n_sw = int(resident.numel()), len(keys)
        pools = []
        for side, pool in ((0, pl.k_pool), (1, pl.v_pool)):
            tmp = torch.empty(n_res + n_sw, pool.shape[1], dtype=torch.uint8, device=pool.device)
            if n_res:
                tmp[:n_res] = pool[resident]
            if pool.shape[1]:  # a side may be empty (a latent layer's record member has no V)
                raw = bytearray().join(item[side] for item in got)
                tmp[n_res:] = torch.frombuffer(raw, dtype=torch.uint8).view(n_sw, -1).to(pool.device)
            pools.append(tmp)
        return dataclasses.replace(pl, k_pool=pools[0], v_pool=pools[1])


class PrefixPolicy:
    """A shared prefix store over one block group (blocks keyed by the group's chain hashes and
    `tag`, the group's name in the store keys)."""

    def __init__(self, store: PrefixStore, tag: bytes = b""):
        self.store = store
        self.tag = tag
        self.layouts = _Layouts()

    def fetch(self, layers: Sequence[PagedLayer], chains: Sequence[bytes]):
        """The stored sections of these chain keys, in order, None at the first miss."""
        return self.store.fetch(self.layouts.of(layers), chains, self.tag)

    def publish(self, seqs: SequenceManager, seq_id: Hashable, layers: Sequence[PagedLayer]) -> int:
        blocks = seqs.newly_full(seq_id)
        if not blocks:
            return 0
        return self.store.publish_many(layers, self.layouts.of(layers), blocks, self.tag)
