"""The data plane of the engine cache, per layer: store (after the slot check, into the layer's
block group and, with a recent window, into its tail), attention on the pools (through a view
with swapped blocks read back when the tiers swapped some; with a recent window through
`ops.recent`), gather (tests and oracles). `PagedCache` holds one (`cache.kv_plane`) and calls it; the storage
(`groups.GroupStorage`), the slot handouts (`handouts.Handouts`), the transforms
(`transforms.LayerTransforms`) and the tiers (`tiering.CacheTiers`, or None) are the cache's,
given to it at construction. It owns only the memo of the slot tensors it checked.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ..errors import ConfigError, InvalidInput
from ..ops import api as ops
from ..ops import recent
from ..ops.batch import AttentionParams, PagedLayer
from ..ops.validate import check_store
from . import storage
from .handouts import pending_mask, version
from .tables import GroupSlots


class DataPlane:
    """Store / attend / gather of one `PagedCache`'s K/V layers (see the module doc)."""

    def __init__(self, storage, handouts, transforms, tiers, config):
        self.storage, self.handouts, self.transforms, self.tiers = storage, handouts, transforms, tiers
        self.config = config
        self.block_size = config.block_size
        self._checked: dict = {}  # group -> (slot tensor, its _version, pool.version, epoch)

    def layer(self, layer: int) -> PagedLayer:
        """Layer `layer` (K/V or latent), the index checked."""
        return self.storage.layers[self.storage.index(layer)]

    def check_slots(self, slot_mapping: torch.Tensor, group: int = 0) -> None:
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 \
                or slot_mapping.dim() != 1:
            raise InvalidInput(
                f"slot_mapping must be an int64 [T] tensor, got "
                f"{getattr(slot_mapping, 'dtype', type(slot_mapping).__name__)} "
                f"{list(getattr(slot_mapping, 'shape', []))}"
            )
        pool = self.storage.group(group).pool
        epoch = self.handouts.epoch
        last, tv, pv, ep = self._checked.get(group, (None, -1, -1, -1))
        if last is slot_mapping and tv is not None and tv == version(slot_mapping) \
                and pv == pool.version and ep == epoch:
            return  # the same, unmodified tensor was checked for an earlier layer of this step
        s = slot_mapping.detach().cpu()
        s = s[s >= 0]
        if not s.numel():
            return
        bs = self.block_size
        hi = int(s.max())
        if hi >= pool.num_blocks * bs:
            raise InvalidInput(f"slot {hi} is outside the pool ({pool.num_blocks} blocks x {bs})")
        blocks, offs = s // bs, s % bs
        in_use = torch.frombuffer(pool.in_use, dtype=torch.uint8)
        fill = torch.frombuffer(pool.fill, dtype=torch.int32)  # zero-copy view
        bad = (in_use[blocks] == 0) | (offs >= fill[blocks].long())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InvalidInput(
                f"slot {int(s[i])} (block {int(blocks[i])}, offset {int(offs[i])}) was not "
                "allocated to any sequence; store only at slots returned by add_sequence, "
                "allocate or step"
            )
        keyed = torch.frombuffer(pool.keyed, dtype=torch.uint8)[blocks]
        if bool(keyed.any()):
            i = int(keyed.nonzero()[0, 0])
            raise InvalidInput(
                f"slot {int(s[i])} is in block {int(blocks[i])}, a committed prefix block that "
                "other sequences may share; its K/V are already stored (store only the tokens "
                "after NewSequence.hit_tokens)"
            )
        if torch.unique(s).numel() != s.numel():
            raise InvalidInput("slot_mapping holds the same slot twice")
        self.handouts.check(slot_mapping, s, group,
                            lambda: pending_mask(self.storage.group(group), pool.num_blocks * bs))
        self._checked[group] = (slot_mapping, version(slot_mapping), pool.version, epoch)

    def kv(self, layer: int) -> PagedLayer:
        """Layer `layer`, a K/V layer (`GroupStorage.kv`)."""
        return self.storage.kv(layer)

    def store_slots(self, layer: int, slot_mapping):
        """(slots of layer `layer`'s group, the tail's slots or None) from what `store` takes,
        checked (unless config.check_slots is False) before anything is written."""
        g = self.storage.group_of(layer)
        tail_slots = None
        if isinstance(slot_mapping, GroupSlots):
            slots, tail_slots = slot_mapping.layer_slots(layer), slot_mapping.tail_slots
        elif self.storage.tails is not None:
            raise ConfigError("with a recent window, store needs the StepBatch or NewSequence "
                              "(the tail has its own slots), not a slot tensor")
        else:
            slots = slot_mapping
        if self.config.check_slots:
            self.check_slots(slots, g)
            if tail_slots is not None:
                self.check_slots(tail_slots, self.storage.layout.tail_group)
        return slots, tail_slots

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping, **op_kwargs) -> None:
        """Encode k, v (float [T, H, D]) into layer `layer`'s pools at the new tokens' slots:
        `slot_mapping` is the `StepBatch` / `NewSequence` that handed them out (the cache picks
        the layer's block group and, with a recent window, the tail's), or an int64 [T] tensor
        of slots in the layer's group (negative = skip; not with a recent window). Slots must
        have been allocated (checked unless config.check_slots is False). `op_kwargs`
        (backend, checks) go to `ops.store`. Raises before writing anything."""
        pl = self.kv(layer)
        slots, tail_slots = self.store_slots(layer, slot_mapping)
        if tail_slots is None:
            ops.store(pl, k, v, slots, **op_kwargs)
        else:
            tail = self.storage.tails[layer]
            check_store(tail, k, v, tail_slots, True)  # the tail's inputs are valid before any write
            ops.store(pl, k, v, slots, **op_kwargs)
            ops.store(tail, k, v, tail_slots, **op_kwargs)
        self.transforms.stored(layer)

    # ---- attention ----------------------------------------------------------------------------
    def attention_view(self, layer: int, seq_ids: Sequence[Hashable]
                       ) -> tuple[PagedLayer, torch.Tensor, torch.Tensor]:
        """(PagedLayer, or the LatentLayer of a latent layer; block_tables int32 [B, max_blocks],
        seq_lens int32 [B]) for attention of `seq_ids` in `layer`: the layer itself and the cache's tables when nothing of the batch
        is swapped, else a temporary layer whose pools hold the batch's resident blocks then its
        swapped blocks read back (the same bytes, so any attention op gives the same result).
        The tables and lengths are built once per step for every layer (the cache's own tensors,
        read-only, as the layer is). Raises SwapLost, naming the sequences and tokens, if a
        swapped block is not intact."""
        pl = self.layer(layer)
        ids = tuple(seq_ids)
        lens = self.storage.view_tensors(("lens", ids), lambda: self.storage.seq_lens(ids))
        got = None if self.tiers is None else self.tiers.view_of(
            "main", layer, self.storage.group_of(layer), seq_ids, self.storage.epoch, self.storage.device)
        if got is None:
            g = self.storage.group_of(layer)
            return pl, self.storage.view_tensors((g, ids), lambda: self.storage.group_tables(g, ids)), lens
        return storage.from_record_member(pl, got[0]), got[1], lens

    def tail_view(self, layer: int, seq_ids: Sequence[Hashable]) -> tuple[PagedLayer, torch.Tensor]:
        """(the layer's recent-window tail, its block tables int32 [B, max_blocks]): what
        `ops.recent` reads the last R positions from (ConfigError without a recent window)."""
        self.layer(layer)
        if self.storage.tails is None:
            raise ConfigError("this cache has no recent window (CacheConfig.recent_window)")
        g = self.storage.layout.tail_group
        got = None if self.tiers is None else self.tiers.view_of(
            "tail", layer, g, seq_ids, self.storage.epoch, self.storage.device)
        if got is not None:
            return got
        ids = tuple(seq_ids)
        return self.storage.tails[layer], self.storage.view_tensors((g, ids), lambda: self.storage.group_tables(g, ids))

    def check_window(self, layer: int, params: AttentionParams) -> None:
        w = self.storage.group(self.storage.group_of(layer)).window
        if w is not None and (params.sliding_window is None or params.sliding_window > w):
            raise InvalidInput(
                f"layer {layer} attends with sliding_window={params.sliding_window} but its block "
                f"group keeps only the last {w} tokens (CacheConfig.sliding_window; "
                "reclaim_sliding=False keeps every token)")

    def decode_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                         params: AttentionParams, **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.decode_attention` of q float [B, Hq, D] over `seq_ids` in `layer`
        (swapped blocks read back; with a recent window `ops.recent.recent_decode_attention`,
        which takes `checks` only). Returns [B, Hq, D]."""
        self.kv(layer)
        self.check_window(layer, params)
        pl, tables, lens = self.attention_view(layer, seq_ids)
        if self.storage.tails is not None:
            tail, tail_tables = self.tail_view(layer, seq_ids)
            return recent.recent_decode_attention(
                q, pl, tail, tables, lens, params, recent=self.config.recent_window.tokens,
                tail_block_tables=tail_tables, sinks=self.config.recent_window.sinks, **op_kwargs)
        return ops.decode_attention(q, pl, tables, lens, params, **op_kwargs)

    def prefill_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                          query_start_loc: torch.Tensor, params: AttentionParams,
                          **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.prefill_attention` of packed q float [Tq, Hq, D] (new tokens already
        stored) over `seq_ids` in `layer` (swapped blocks read back; with a recent window
        `ops.recent.recent_prefill_attention`). Returns [Tq, Hq, D]."""
        self.kv(layer)
        self.check_window(layer, params)
        pl, tables, lens = self.attention_view(layer, seq_ids)
        if self.storage.tails is not None:
            tail, tail_tables = self.tail_view(layer, seq_ids)
            return recent.recent_prefill_attention(
                q, pl, tail, tables, lens, query_start_loc, params,
                recent=self.config.recent_window.tokens, tail_block_tables=tail_tables,
                sinks=self.config.recent_window.sinks, **op_kwargs)
        return ops.prefill_attention(q, pl, tables, lens, query_start_loc, params, **op_kwargs)

    def gather(self, layer: int, seq_id: Hashable, *, tail: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a sequence's stored K and V in `layer` (swapped blocks included; `tail=True`:
        from the recent window's tail): float32 [len, H, D] each, in the original basis
        (transform undone); NaN rows where a sliding window released the block. For tests and
        oracles."""
        self.kv(layer)
        if tail:
            pl, tables = self.tail_view(layer, [seq_id])
            g = self.storage.layout.tail_group
        else:
            pl, tables, _ = self.attention_view(layer, [seq_id])
            g = self.storage.group_of(layer)
        slots, released = storage.sequence_rows(tables[0], self.storage.group(g).table(seq_id), self.storage.core.main.length(seq_id),
                                                self.block_size, self.storage.device)
        k, v = (storage.gather_side(pl, side, slots).masked_fill(released[:, None, None], float("nan"))
                for side in ("k", "v"))
        return k, v
