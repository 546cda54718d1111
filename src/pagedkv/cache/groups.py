"""The block groups of the engine cache: one per distinct sliding window, plus the recent window.

`group_layout(config)` splits the storage into block groups (`pagedkv.alloc.BlockManager`): the
global layers (window None, a fixed pool of `config.total_blocks` blocks), one group per distinct
sliding window W (with `config.reclaim_sliding`; a pool that starts small, grows by doubling up
to `total_blocks` and is compacted when most of its blocks left the window, so the memory of
positions no query can see is returned), and, with `config.recent_window` R, the tails of every
layer in the group of window R (shared with sliding layers of that window). A block id of a group
addresses the same slots in every member of that group; each group has its own tables and slots.

`GroupStorage` (held by `PagedCache` as `cache.storage`) owns the members' tensors and the block
manager, and applies the block manager's per-group plan steps to them (`storage.apply_group_step`:
moves, cut or growth, copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..alloc.manager import BlockManager, GroupSpec, GroupStep
from ..errors import ConfigError
from ..ops.batch import PagedLayer
from . import storage
from .config import CacheConfig
from .tables import block_table_tensor, int_tensor

SLIDING_INITIAL_BLOCKS = 16  # a sliding group's first pool size (it grows on demand)
UNBOUNDED = 1 << 40  # CacheConfig(grow_blocks=True): a block-id limit no pool reaches


@dataclass(frozen=True)
class GroupLayout:
    """Which block group holds what. windows[g]: group g's window (None = global; groups of main
    layers first, global first, then windows ascending; a tail-only window last);
    layer_group[i]: the group of layer i's pages; tail_group: the group of every layer's tail
    (None without a recent window); members[g]: ("main" | "tail", layer) pairs."""

    windows: tuple[Optional[int], ...]
    layer_group: tuple[int, ...]
    tail_group: Optional[int]
    members: tuple[tuple[tuple[str, int], ...], ...]
    keep_first: tuple[int, ...]  # per group: leading blocks never released (the sinks)


def group_layout(config: CacheConfig) -> GroupLayout:
    wins = [s.sliding_window if config.reclaim_sliding else None for s in config.layers]
    keys = sorted(set(wins), key=lambda w: (w is not None, w or 0))
    members = [[("main", i) for i, w in enumerate(wins) if w == key] for key in keys]
    keep = [0] * len(keys)
    tail = None
    rw = config.recent_window
    if rw is not None:
        first = tail_keep_blocks(rw, config.block_size)
        if first or rw.tokens not in keys:  # a tail keeping its sinks never shares a group
            keys.append(rw.tokens)
            members.append([])
            keep.append(first)
            tail = len(keys) - 1
        else:
            tail = keys.index(rw.tokens)
        members[tail] += [("tail", i) for i in range(len(wins))]
    return GroupLayout(tuple(keys), tuple(keys.index(w) for w in wins), tail,
                       tuple(tuple(m) for m in members), tuple(keep))


def group_tags(layout: GroupLayout) -> list[bytes]:
    """Each group's name in a prefix store's keys: b"" for the global group (the keys of a
    cache with one group), else its window, kept blocks and members (two groups of one cache
    can have the same record layout)."""
    return [b"" if w is None else repr((w, k, m)).encode()
            for w, k, m in zip(layout.windows, layout.keep_first, layout.members)]


def tail_keep_blocks(recent, block_size: int) -> int:
    """Leading blocks a recent window's tail group keeps for every sequence: those covering its
    attention sinks (`RecentWindow.sinks` first positions)."""
    from ..ops.recent import sink_blocks

    return sink_blocks(recent.sinks, block_size)


def group_specs(layout: GroupLayout, total: int, grow: bool = False,
                keep_cached: bool = False) -> list[GroupSpec]:
    """The block manager's groups: the global pool fixed at `total` blocks, sliding ones from
    at most 16 up to `total`; with `grow` (CacheConfig.grow_blocks) every pool grows unbounded;
    with `keep_cached` (CacheConfig.keep_window_prefixes) sliding ones keep their cached blocks."""
    limit = UNBOUNDED if grow else total
    return [GroupSpec(None, total, UNBOUNDED if grow else None) if w is None else
            GroupSpec(w, min(total, SLIDING_INITIAL_BLOCKS), limit, k, keep_cached)
            for w, k in zip(layout.windows, layout.keep_first)]


class GroupStorage:
    """The members' tensors of every block group of one `PagedCache`, and the block manager that
    numbers their blocks (see the module doc): the one owner of `layout` (`GroupLayout`), `core`
    (`alloc.BlockManager`), `layers` and `tails` (the recent window's, or None). `epoch` bumps
    whenever tables or layers change (the views attention reads are built once per epoch).
    `moved(g)` is called before a plan moves or cuts group g's blocks (slots handed out before
    then name other blocks); `shows_swapped`: a swapped table entry reads -1 (with offload
    tiers), else 0."""

    def __init__(self, config: CacheConfig):
        self.config = config
        self.layout = group_layout(config)
        specs = group_specs(self.layout, config.total_blocks, config.grow_blocks,
                            config.keep_window_prefixes)
        self.core = BlockManager(specs, config.block_size, config.fingerprint, trace=config.trace)
        self.device = config.device
        sizes = [s.initial_blocks for s in specs]
        self.layers: tuple[PagedLayer, ...] = tuple(
            storage.build_layer(s, sizes[g], config.block_size, config.device, config.key_centring)
            for s, g in zip(config.layers, self.layout.layer_group))
        self.tails: Optional[tuple[PagedLayer, ...]] = None
        if config.recent_window is not None:
            n = sizes[self.layout.tail_group]
            self.tails = tuple(storage.build_tail(pl, config.recent_window.codec, n) for pl in self.layers)
        self.epoch = 0
        self.moved = lambda g: None
        self.shows_swapped = False
        self._memo: tuple = (-1, {})  # (epoch, key -> tensors built in it)

    def changed(self) -> None:
        self.epoch += 1

    def member(self, kind: str, i: int) -> PagedLayer:
        """Layer i's pages ("main") or its recent-window tail ("tail")."""
        return self.layers[i] if kind == "main" else self.tails[i]

    def set_layers(self, new: dict) -> None:
        """Replace layers (index -> layer with the same pools, e.g. another transform); their
        recent-window tails take the new transform."""
        layers = list(self.layers)
        for i, pl in new.items():
            layers[i] = pl
        self.layers = tuple(layers)
        if self.tails is not None and new:
            self.tails = tuple(storage.with_transform(t, self.layers[i]) if i in new else t
                               for i, t in enumerate(self.tails))
        self.changed()

    def group(self, index: int):
        """The `SequenceManager` of block group `index`."""
        return self.core.groups[index]

    def _apply_group(self, g: int, step: GroupStep) -> None:
        if step.moves or step.num_blocks < self._pool_rows(g):
            self.moved(g)
        layers, tails = list(self.layers), None if self.tails is None else list(self.tails)
        for kind, i in self.layout.members[g]:
            if kind == "main":
                layers[i] = storage.apply_group_step(layers[i], step)
            else:
                tails[i] = storage.apply_group_step(tails[i], step)
        self.layers = tuple(layers)
        self.tails = None if tails is None else tuple(tails)

    def apply(self, plan) -> None:
        """Apply a plan's data-plane part (per group: moves, cut / growth, copy-on-write copies)
        to every member of the group."""
        for g, gs in enumerate(plan.groups):
            if gs.moves or gs.copies or gs.num_blocks != self._pool_rows(g):
                self._apply_group(g, gs)
        self.changed()

    def _pool_rows(self, g: int) -> int:
        return self.member(*self.layout.members[g][0]).num_blocks

    def sync_sizes(self) -> None:
        """Resize the pools of groups whose block pool grew outside a step (admission)."""
        for g, seqs in enumerate(self.core.groups):
            if seqs.pool.num_blocks != self._pool_rows(g):
                self._apply_group(g, GroupStep((), seqs.pool.num_blocks, (), ()))

    def index(self, layer) -> int:
        """`layer` checked: an int in [0, layers) (ConfigError)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(self.layers):
            raise ConfigError(f"layer must be an int in [0, {len(self.layers)}), got {layer!r}")
        return layer

    def kv(self, layer: int) -> PagedLayer:
        """Layer `layer`, a K/V layer (ConfigError naming the latent methods for a latent one)."""
        pl = self.layers[self.index(layer)]
        if not isinstance(pl, PagedLayer):
            raise ConfigError(f"layer {layer} is a latent (MLA) layer: use store_latent / "
                              "latent_decode_attention / latent_prefill_attention / gather_latent")
        return pl

    def group_of(self, layer: int) -> int:
        """The block group of layer `layer`'s pages (index into `core.groups`)."""
        return self.layout.layer_group[self.index(layer)]

    def view_tensors(self, key, build):
        """`build()` once per key while nothing changes (`epoch`): the tables and lengths every
        layer of a step attends with (internal: never handed to a caller who could modify it)."""
        if self._memo[0] != self.epoch:
            self._memo = (self.epoch, {})
        got = self._memo[1].get(key)
        if got is None:
            got = self._memo[1][key] = build()
        return got

    def group_tables(self, g: int, seq_ids) -> torch.Tensor:
        """int32 [B, max_blocks] of group g, 0-padded. Entries a sliding group released read 0
        (no query of the window reads them: the ops skip or mask them); a swapped entry reads
        -1 with `shows_swapped` (so a direct op call fails loudly)."""
        seqs = self.core.groups[g]
        t = block_table_tensor([seqs.table(i) for i in seq_ids], torch.device("cpu"))
        if seqs.window is not None:
            t = torch.where(t == -1, 0, t)  # released (RELEASED = -1) reads block 0
        t = t.clamp(min=-1 if self.shows_swapped else 0)  # a swapped entry is -2 - record
        return t if self.device.type == "cpu" else t.to(self.device)

    def seq_lens(self, seq_ids) -> torch.Tensor:
        """int32 [B]: the sequences' lengths."""
        return int_tensor([self.core.main.length(i) for i in seq_ids], torch.int32, self.device)

    def block_bytes(self, g: int) -> int:
        """Bytes one block id of group g takes over its members (its layers' K and V blocks or
        latent blocks, and the recent-window tails it holds)."""
        return sum(getattr(m, name).shape[1] for m in (self.member(*km) for km in self.layout.members[g])
                   for name in storage.pool_names(m))

    def stats(self) -> "CacheStats":
        """The cache's `CacheStats` now (the first block group's pool and prefix counters)."""
        layer_bytes = tuple(storage.layer_bytes(pl) for pl in self.layers)
        tail_bytes = sum(sum(storage.layer_bytes(t)) for t in self.tails or ())
        s = self.core.main
        p, q = s.pool, s.prefix_query_tokens
        return CacheStats(
            num_blocks=self.config.total_blocks, block_size=self.config.block_size, blocks_free=p.num_free,
            blocks_used=p.num_used, blocks_cached=p.num_cached, num_sequences=len(s),
            tokens_stored=sum(s.length(i) for i in s.ids()), bytes_per_block=self.config.bytes_per_block,
            layer_bytes=layer_bytes, total_bytes=sum(k + v for k, v in layer_bytes) + tail_bytes,
            prefix_queries=s.prefix_queries, prefix_query_tokens=q, prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_hit_rate=(s.prefix_hit_tokens / q) if q else 0.0, evictions=p.evictions,
            groups=self.group_stats(), tail_bytes=tail_bytes)

    def group_stats(self) -> tuple:
        """Per block group: (window, pool blocks, used, free, cached, bytes of its pools)."""
        out = []
        for g, seqs in enumerate(self.core.groups):
            nbytes = sum(sum(storage.layer_bytes(self.member(*km))) for km in self.layout.members[g])
            p = seqs.pool
            out.append(GroupStats(seqs.window, p.num_blocks, p.num_used, p.num_free, p.num_cached,
                                  nbytes))
        return tuple(out)


@dataclass(frozen=True)
class GroupStats:
    """One block group in `CacheStats.groups`: its window (None = global), pool size, blocks
    held / free / cached, and the bytes of its members' pools now."""

    window: Optional[int]
    num_blocks: int
    blocks_used: int
    blocks_free: int
    blocks_cached: int
    pool_bytes: int


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache. Bytes are the pool tensors' sizes.

    blocks_free + blocks_used + blocks_cached == num_blocks. tokens_stored: tokens held by all
    sequences (shared blocks counted once per sequence). layer_bytes: per layer (k, v).
    prefix_hit_rate: hit tokens / prompt tokens looked up by add_sequence (0.0 before any).
    """

    num_blocks: int
    block_size: int
    blocks_free: int
    blocks_used: int
    blocks_cached: int
    num_sequences: int
    tokens_stored: int
    bytes_per_block: int
    layer_bytes: tuple[tuple[int, int], ...]
    total_bytes: int
    prefix_queries: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    evictions: int
    groups: tuple = ()  # GroupStats per block group (window, blocks, bytes)
    tail_bytes: int = 0  # the recent window's tail pools (included in total_bytes)
