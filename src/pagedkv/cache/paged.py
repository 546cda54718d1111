"""PagedCache: the pools of every layer plus the sequences that own their blocks.

Typical step (every call validates first; failures raise before any state changes):

    cache = PagedCache(CacheConfig(num_layers=28, num_kv_heads=8, head_dim=128,
                                   kv_format="turbo3", memory_bytes=2 << 30))
    new = cache.add_sequence(prompt_ids)            # reuses cached prefix blocks
    # run the model on prompt_ids[new.hit_tokens:], per layer:
    #     cache.store(layer, k, v, new.slot_mapping); attention with cache.layers[layer]
    cache.commit(new.seq_id)                        # K/V written: full blocks become hits
    batch = cache.step([sid, ...], [[tok], ...])    # decode: slots + tables for all sequences
    ...; cache.commit([sid, ...])
    cache.pop(sid, 3)                               # speculative rollback
    cache.free(sid)

`cache.layers[i]` is the `PagedLayer` ops consume. With `CacheConfig(latent=...)` (MLA) every
layer is a `LatentLayer`: `store_latent` / `latent_decode_attention` / `latent_prefill_attention`
(`cache/latent_plane.py`) instead of the K/V methods; everything else is the same. `commit`
is what makes a full block findable by later prefix lookups; a block is never keyed before its
K/V were stored in every layer.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Optional, Sequence, Union

import torch

from ..alloc.hashing import Salt
from ..alloc.trace import BlockTrace
from ..compose import calls
from ..errors import ConfigError
from .config import CacheConfig
from .dataplane import DataPlane
from . import storage
from .groups import CacheStats, GroupStorage  # noqa: F401 (CacheStats: re-exported)
from .handouts import Handouts
from .latent_plane import LatentPlane
from .tables import NewSequence, StepBatch, int_tensor  # noqa: F401 (NewSequence: re-exported)
from .transforms import LayerTransforms


class PagedCache:
    """Paged KV storage for every attention layer of one model, on the block manager.

    layers: tuple of PagedLayer (index = cache layer). Sequence ids are any hashable value given
    by the caller, or ints handed out by `add_sequence`/`fork`.

    Block groups (`cache/groups.py`): layers with a sliding window (CacheConfig.sliding_window,
    with reclaim_sliding) live in one group per distinct window, whose blocks wholly before
    `n - W + 1` are released before a sequence of n tokens grows (its pool shrinks when most
    blocks left), so `pop` cannot go back past them; with `recent_window` every layer's tail
    lives in the group of window R. Each group has its own block ids, tables and slots:
    `StepBatch.layer_slots(i)` / `layer_tables(i)`, `block_tables(ids, layer=i)`; `store`
    takes the StepBatch / NewSequence itself and picks the layer's slots (and the tail's).
    A pool of a sliding group is replaced when it grows or shrinks: read `cache.layers[i]`
    after each step, do not keep it.

    offload: None, or an `pagedkv.offload.OffloadConfig`: the resident cap (after each commit a
    sequence holding more than N blocks in memory swaps its oldest full committed blocks out;
    attention through `decode_attention` / `prefill_attention` / `attention_view` reads them
    back, bit-identical; `step` / `block_tables` show -1 there so a direct op call fails loudly)
    and the shared prefix store (`add_sequence` loads stored prefix blocks first, `commit`
    publishes newly full ones; `NewSequence.hit_tokens` counts both kinds of hit,
    `offload_stats()` says which). A swap write that fails raises TierWriteError from `commit`
    after the commit itself took effect (blocks stay resident; committing again retries);
    prefix-store faults never raise. swap_tier / prefix_tier: tiers to use instead of those
    `offload` describes. `close()` (or `with`) deletes this cache's swap records.

    fit_first_chunk: a front door fits every K/V layer's transform on that layer's first chunk
    (`fit_layer`, the transformers drop-in): the tiers publish and swap nothing before every
    layer is fitted, then publish the transform with the blocks; a cache that fitted none
    adopts a prefix store's at `add_sequence` / `load_prefix` (as latent layers do).

    Parts, each the one owner of its state, held and called (composition): `storage`
    (`groups.GroupStorage`: the block manager `core`, the layers, tails and block-group layout),
    `handouts` (which slot tensors may be written), `transforms` (the layer transforms), `tiers`
    (offload, or None), `kv_plane` / `latent_plane` (store, attend, gather).
    """

    def __init__(self, config: CacheConfig, offload=None, *, swap_tier=None, prefix_tier=None,
                 fit_first_chunk: bool = False):
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"PagedCache needs a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.block_size, self.num_blocks, self.device = config.block_size, config.total_blocks, config.device
        self.tiers = None
        self.storage = GroupStorage(config)  # the block manager, layers, tails, block groups
        self.handouts = Handouts(len(self.core.groups))  # which slot tensors may still be written
        self.storage.moved = self.handouts.group_moved
        self.transforms = LayerTransforms(self.storage, config, fit_first_chunk)  # the layers' transforms: set, fitted, shared
        if offload is not None or swap_tier is not None or prefix_tier is not None:
            from ..offload.config import OffloadConfig
            from .tiering import CacheTiers

            self.tiers = CacheTiers(self.storage, self.transforms, config,
                                    OffloadConfig() if offload is None else offload, swap_tier, prefix_tier)
            self.storage.shows_swapped = True
        self.kv_plane = DataPlane(self.storage, self.handouts, self.transforms, self.tiers, config)
        self.latent_plane = LatentPlane(self.kv_plane)

    fit_first_chunk = property(lambda self: self.transforms.fit_first_chunk,
                               doc="whether a front door fits each K/V layer on its first chunk (`LayerTransforms`)")

    # ---- the storage's state (`groups.GroupStorage` owns it) ------------------------------------
    layers = property(lambda self: self.storage.layers, lambda self, new: setattr(self.storage, "layers", tuple(new)),
                      doc="tuple of PagedLayer / LatentLayer, index = layer (assigned: `storage.layers`)")
    tails = property(lambda self: self.storage.tails, doc="the recent window's tails per layer, or None")
    groups = property(lambda self: self.storage.layout, doc="the block groups' `GroupLayout`")
    core = property(lambda self: self.storage.core, doc="the block manager (`alloc.BlockManager`)")
    seqs = property(lambda self: self.storage.core.main, doc="the first block group's `SequenceManager`")
    pool = property(lambda self: self.storage.core.main.pool, doc="the first block group's `BlockPool`")

    set_layers = calls("storage", GroupStorage.set_layers)
    group_of = calls("storage", GroupStorage.group_of)
    block_bytes = calls("storage", GroupStorage.block_bytes)
    group_stats = calls("storage", GroupStorage.group_stats)

    def _dropped(self) -> None:
        """Table entries went: delete the swap records nothing names any more."""
        self.storage.changed()
        if self.tiers is not None:
            self.tiers.drop_dead()

    def _reclaimed(self) -> None:
        """A step's window reclaim may have dropped swapped entries: delete their records."""
        if self.tiers is not None:
            self.tiers.drop_dead()

    def _slots_of(self, group_slots, seq_ids) -> dict:
        """The GroupSlots fields of per-group slot lists (tensors on the cache's device, recorded
        as handed out for `seq_ids`)."""
        ts = tuple(int_tensor(s, torch.int64, self.device) for s in group_slots)
        self.handouts.record(ts, seq_ids)
        multi = len(ts) > 1
        return dict(slot_mapping=ts[0], group_slots=ts if multi else (),
                    layer_group=self.groups.layer_group if multi else (),
                    tail_group=self.groups.tail_group)

    def _ids(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> list:
        if isinstance(seq_ids, (list, tuple, set, frozenset)) and seq_ids not in self.seqs:
            return list(seq_ids)
        return [seq_ids]

    # ---- sequences ------------------------------------------------------------------------
    def add_sequence(self, tokens: Sequence[int], salt: Salt = None,
                     seq_id: Optional[Hashable] = None, *, max_hit_blocks: Optional[int] = None,
                     rest: bool = True, load: bool = True) -> NewSequence:
        """Admit a prompt. Full blocks whose keys (token chain + salt + cache fingerprint) are
        cached (in memory, or in the prefix store: loaded first unless `load` is False) are
        shared instead of recomputed (at most max_hit_blocks); hits are whole blocks and always
        fewer than len(tokens). Store K/V of `tokens[hit_tokens:]` at `slot_mapping`, then
        `commit`. rest=False holds the hit only (the rest comes with `step`)."""
        before = None  # hit blocks in memory before the prefix store was asked
        if self.tiers is not None and load:
            tokens, before = self.tiers.before_add(self.seqs, tokens, salt, seq_id)
        sid, hit, slots = self.core.add(seq_id, tokens, salt, rest=rest, max_hit_blocks=max_hit_blocks)
        self.handouts.changed([sid])
        self.storage.sync_sizes()  # an admission may grow a sliding group's pool
        self.storage.changed()
        if before is not None:
            self.tiers.tier_hit_tokens += max(0, hit - before * self.block_size)
        return NewSequence(sid, hit, **self._slots_of(slots, [sid]))

    def load_prefix(self, tokens: Sequence[int], salt: Salt = None) -> None:
        """Bring a prompt's longest stored hit up from the prefix store into the pools (cached
        blocks, where a later `add_sequence` finds them) without admitting it; a cache that may
        adopts the store's transform first. Nothing without a prefix store."""
        if self.tiers is not None:
            self.tiers.before_add(self.seqs, tokens, salt, None)

    def allocate(self, seq_id: Hashable, tokens: Union[int, Sequence[int]]) -> torch.Tensor:
        """Slots (int64 [n], the first block group's) for new tokens at the end of a sequence:
        their ids, or a count when the ids are unknown (such blocks are never prefix-keyed). A
        shared partly filled last block is copied first, in every layer. With several block
        groups use `step`, whose StepBatch has every layer's slots."""
        self.seqs._get(seq_id)
        plan = self.core.step([seq_id], [tokens])
        self.storage.apply(plan)
        self._reclaimed()
        return self._slots_of([plan.groups[0].slots], [seq_id])["slot_mapping"]

    def step(self, seq_ids: Sequence[Hashable], tokens: Sequence[Union[int, Sequence[int]]]
             ) -> StepBatch:
        """Allocate new tokens for several sequences at once (all or nothing) and build the
        step's tensors: slot mapping, block tables (-1 where swapped), seq_lens,
        query_start_loc."""
        for i in seq_ids:
            self.seqs._get(i)
        plan = self.core.step(seq_ids, tokens)
        self.storage.apply(plan)
        self._reclaimed()
        starts = [0]
        for n in plan.counts:
            starts.append(starts[-1] + n)
        tables = tuple(self.storage.group_tables(g, seq_ids) for g in range(len(plan.groups)))
        slots = self._slots_of([gs.slots for gs in plan.groups], seq_ids)
        return StepBatch(
            block_tables=tables[0],
            seq_lens=self.seq_lens(seq_ids),
            query_start_loc=int_tensor(starts, torch.int32, self.device),
            group_tables=tables if len(tables) > 1 else (), **slots)

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Declare every allocated token's K/V stored in every layer (one id or a list); full
        blocks are then keyed for prefix hits (and published, and the resident cap enforced,
        with offload tiers)."""
        ids = self._ids(seq_ids)
        self.core.commit(ids)
        self.handouts.changed(ids)  # their handed-out slots are written: no longer pending
        self.storage.changed()
        if self.tiers is not None:
            try:
                self.tiers.after_commit(ids)
            finally:
                self.storage.changed()  # the resident cap may have swapped blocks: tables changed

    def fork(self, seq_id: Hashable, new_id: Optional[Hashable] = None) -> Hashable:
        """A copy of a sequence sharing all its blocks and swap records (beam search, parallel
        sampling)."""
        out = self.core.fork(seq_id, new_id)
        self.handouts.changed([out])
        self.storage.changed()
        return out

    def pop(self, seq_id: Hashable, n: int) -> None:
        """Drop the last n tokens (rejected speculative tokens); empty blocks are released. A
        swapped block that becomes the partly filled last block is read back first (CacheFull
        / SwapLost before any change if that is impossible)."""
        rids = self.core.check_pop(seq_id, n)
        sections = None if all(r is None for r in rids) else self.tiers.pop_fetch(rids)
        backs = self.core.pop(seq_id, n)
        self.handouts.changed([seq_id])
        if sections is not None:
            self.tiers.pop_restore(backs, sections)
        self._dropped()

    def reset(self, seq_id: Hashable) -> None:
        """Empty a sequence, keeping its id."""
        self.pop(seq_id, self.seqs.length(seq_id))

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; its committed full blocks stay cached for prefix hits (LRU)."""
        self.core.free(seq_id)
        self.handouts.gone([seq_id])
        self._dropped()

    def clear(self) -> None:
        """Drop every sequence, swap record and cached prefix (the pools keep their bytes)."""
        self.core.clear()
        self.handouts.clear()
        self._dropped()

    def reset_prefix_cache(self) -> int:
        """Forget all prefix keys (every block group); cached blocks return to the free lists.
        Returns how many did."""
        self.storage.changed()
        return sum(g.pool.reset_prefix_cache() for g in self.core.groups)

    # ---- swap -----------------------------------------------------------------------------
    def swapped_blocks(self, seq_id: Hashable) -> tuple[list[int], ...]:
        """Per block group (index g of `core.groups` / `stats().groups`; one entry with one
        group), the logical indices of the sequence's blocks swapped out, sorted."""
        self.seqs._get(seq_id)
        return tuple(g.swapped(seq_id) for g in self.core.groups)

    def resident_blocks(self, seq_id: Hashable) -> tuple[int, ...]:
        """Per block group, how many of the sequence's blocks are in memory (swapped-out and
        window-released entries not counted)."""
        self.seqs._get(seq_id)
        return tuple(sum(1 for e in g.table(seq_id) if e >= 0) for g in self.core.groups)

    def enforce_cap(self, seq_id: Hashable) -> int:
        """Swap out the sequence's oldest full committed blocks until at most the cap stay
        resident (the last block always stays; `commit` does this). Returns how many moved;
        TierWriteError if a write fails (that block and the later ones stay resident)."""
        self.seqs._get(seq_id)
        if self.tiers is None:
            return 0
        moved = self.tiers.enforce(seq_id)
        self.storage.changed()
        return moved

    @property
    def swap(self):
        """The swap space (records, tier, stats) or None without a resident cap."""
        return None if self.tiers is None else self.tiers.space

    @property
    def prefix(self):
        """The shared prefix store or None."""
        return None if self.tiers is None else self.tiers.store

    @property
    def layout(self):
        """The record layout of the layers now (`pagedkv.offload.record.BlockLayout`: what swap
        records and the prefix store hold)."""
        from ..offload.record import BlockLayout

        return BlockLayout.from_layers([storage.record_member(pl) for pl in self.layers])

    @property
    def tier_hit_tokens(self) -> int:
        """Prompt tokens found in the prefix store (not in memory) by add_sequence."""
        return 0 if self.tiers is None else self.tiers.tier_hit_tokens

    def offload_stats(self) -> dict:
        """Counters of the tiers: swap (outs, ins, bytes, read time) and prefix store."""
        if self.tiers is None:
            return {"tier_hit_tokens": 0, "swapped_blocks": 0}
        return {"tier_hit_tokens": self.tiers.tier_hit_tokens,
                **self.tiers.stats(self.seqs.ids())}

    def close(self) -> None:
        """Delete this cache's swap records (and directory) and close the tiers."""
        if self.tiers is not None:
            self.tiers.close()

    def __enter__(self) -> "PagedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- queries --------------------------------------------------------------------------
    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.seqs

    def sequence_ids(self) -> list[Hashable]:
        return self.seqs.ids()

    def seq_len(self, seq_id: Hashable) -> int:
        return self.seqs.length(seq_id)

    def tokens(self, seq_id: Hashable) -> list[int]:
        """The sequence's token ids (-1 where only a count was allocated)."""
        return self.seqs.tokens(seq_id)

    def block_tables(self, seq_ids: Sequence[Hashable], layer: Optional[int] = None) -> torch.Tensor:
        """int32 [B, max_blocks] of layer `layer`'s block group (None: the first group), 0-padded;
        -1 where a block is swapped out; 0 where a sliding window released it."""
        return self.storage.group_tables(0 if layer is None else self.group_of(layer), seq_ids)

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 [B]."""
        return self.storage.seq_lens(seq_ids)

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: Optional[int] = None,
                     layer: Optional[int] = None) -> torch.Tensor:
        """int64 [end - start]: slots of positions start..end-1 of a sequence in layer `layer`'s
        block group (None: the first group); ConfigError if they include swapped-out blocks
        (read those through attention_view / gather), InvalidInput if a window released them."""
        n = self.seqs.length(seq_id)
        end = n if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise ConfigError(f"positions [{start}, {end}) are outside sequence {seq_id!r} of {n}")
        bs = self.block_size
        hit = [i for i in self.seqs.swapped(seq_id) if i * bs < end and (i + 1) * bs > start]
        if hit:
            raise ConfigError(f"positions [{start}, {end}) of sequence {seq_id!r} include "
                              f"swapped-out blocks {hit}; use attention_view / gather to read them")
        seqs = self.seqs if layer is None else self.storage.group(self.group_of(layer))
        return int_tensor(seqs.slots(seq_id, start, end - start), torch.int64, self.device)

    @property
    def trace(self) -> Optional[BlockTrace]:
        """Per-block events (None unless CacheConfig(trace=True))."""
        return self.pool.trace

    stats = calls("storage", GroupStorage.stats)

    # ---- data plane and layer transforms: methods of the parts, called (`compose.calls`) ------
    store = calls("kv_plane", DataPlane.store)
    attention_view = calls("kv_plane", DataPlane.attention_view)
    tail_view = calls("kv_plane", DataPlane.tail_view)
    decode_attention = calls("kv_plane", DataPlane.decode_attention)
    prefill_attention = calls("kv_plane", DataPlane.prefill_attention)
    gather = calls("kv_plane", DataPlane.gather)
    store_latent = calls("latent_plane", LatentPlane.store_latent)
    latent_decode_attention = calls("latent_plane", LatentPlane.latent_decode_attention)
    latent_prefill_attention = calls("latent_plane", LatentPlane.latent_prefill_attention)
    gather_latent = calls("latent_plane", LatentPlane.gather_latent)
    configure_layer = calls("transforms", LayerTransforms.configure)
    calibrate_layer = calls("transforms", LayerTransforms.calibrate)
    fit_layer = calls("transforms", LayerTransforms.fit)
    fit_options = calls("transforms", LayerTransforms.options)
    reset_transforms = calls("transforms", LayerTransforms.reset)
    fitted = property(lambda self: self.transforms.fitted,
                      doc="The layers whose transform is fixed (fitted, or adopted from a prefix store).")
