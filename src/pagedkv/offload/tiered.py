"""TieredCache: a PagedCache with tiers below memory (resident cap + swap, shared prefix store).

It is a `PagedCache` (same API, same results) plus:
- **resident cap** (`OffloadConfig.resident_blocks_per_seq`): after each `commit`, a sequence
  holding more than N blocks in memory swaps its oldest full committed blocks (never its last
  block) out to the swap tier; their pool blocks are released. Attention on such sequences must go
  through `decode_attention` / `prefill_attention` / `attention_view` here, which read the swapped
  blocks back one layer at a time (prefetching the next layer) into a small temporary pool for
  that layer: the attention ops see exactly the bytes they would have seen without the cap, so
  results are bit-identical. `step` / `block_tables` return -1 for swapped entries, so an op
  called directly with them fails validation loudly instead of reading the wrong block.
- **prefix store** (`OffloadConfig.prefix_store`): `add_sequence` loads stored prefix blocks
  (after the in-memory prefix cache) before admitting the prompt; `commit` publishes newly full
  blocks. `NewSequence.hit_tokens` counts both kinds of hit; `offload_stats()` says which.

How swapped entries are kept (the hook into `pagedkv.alloc`, which needs no change there): a
swapped table entry points at a *placeholder block*, one pool block that holds no data and is
referenced once per swapped entry (so fork, pop, free and the invariant check keep working on
plain reference counts); this class maps (sequence, logical block) -> swap record.

Errors: a swap write that fails (disk full, over `swap_limit_bytes`) raises `TierWriteError` from
`commit` AFTER the commit itself took effect: the tokens are committed, the blocks stay resident,
nothing is lost, and calling `commit` again retries the swap. Prefix-store faults never raise.
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence, Union

import torch

from ..alloc.hashing import Salt, chain_hash, root_hash
from ..cache import CacheConfig, NewSequence, PagedCache, StepBatch
from ..cache import storage
from ..cache.tables import block_table_tensor, int_tensor
from ..errors import CacheFull, ConfigError
from ..ops import api as ops
from ..ops.batch import AttentionParams, PagedLayer
from .config import OffloadConfig
from .policy import _HOST, build_tiers, remove_stale_swap_dirs  # noqa: F401 (re-exported)
from .prefix import PrefixStore
from .record import BlockLayout, write_block
from .swap import SwapSpace
from .tiers import SwapLost, Tier


@dataclass(frozen=True)
class _Plan:
    """How one batch of sequences is laid out for attention: block tables into either the real
    pools (`keys` empty) or a temporary pool of `resident` blocks followed by swapped records."""

    block_tables: torch.Tensor  # int32 [B, max_blocks]
    seq_lens: torch.Tensor  # int32 [B]
    resident: Optional[torch.Tensor]  # int64 [n_res] pool block ids copied first
    keys: tuple[str, ...]  # swap records appended after them


class TieredCache(PagedCache):
    """PagedCache plus swap below a per-sequence resident cap and a shared prefix store.

    swap_tier / prefix_tier: tiers to use instead of those `offload` describes (tests, sharing
    one tier between caches). Call `close()` (or use `with`) to delete this cache's swap files.
    """

    def __init__(self, config: CacheConfig, offload: OffloadConfig = OffloadConfig(), *,
                 swap_tier: Optional[Tier] = None, prefix_tier: Optional[Tier] = None):
        if not isinstance(offload, OffloadConfig):
            raise ConfigError(f"offload must be an OffloadConfig, got {type(offload).__name__}")
        super().__init__(config)
        self.offload = offload
        self.cap = offload.resident_blocks_per_seq
        self._layout_for: Optional[tuple[PagedLayer, ...]] = None
        self._layout: Optional[BlockLayout] = None
        self._epoch = 0
        self._plan_cache: Optional[tuple] = None
        self._finalizer = None

        self.swap, self.prefix, self._finalizer = build_tiers(self, config, offload, swap_tier, prefix_tier)
        self._swapped: dict[Hashable, dict[int, str]] = {}
        self._ph: Optional[int] = None  # placeholder block of swapped entries
        self._ph_refs = 0
        self._salt: dict[Hashable, Salt] = {}
        self._chains: dict[Hashable, list[bytes]] = {}  # chain keys of considered full blocks
        self._no_publish: set[Hashable] = set()
        self.tier_hit_tokens = 0

    # ---- layout -----------------------------------------------------------------------------
    @property
    def layout(self) -> BlockLayout:
        """The record layout of the current layers (recomputed after `configure_layer`)."""
        if self._layout_for is not self.layers:
            self._layout = BlockLayout.from_layers(self.layers)
            self._layout_for = self.layers
        return self._layout  # type: ignore[return-value]

    def _changed(self) -> None:
        self._epoch += 1

    # ---- sequences --------------------------------------------------------------------------
    def add_sequence(self, tokens: Sequence[int], salt: Salt = None,
                     seq_id: Optional[Hashable] = None) -> NewSequence:
        """PagedCache.add_sequence, after loading the prompt's stored prefix blocks (if a prefix
        store is configured) into the pool's prefix cache, where the admission finds them.
        Loaded blocks stay cached (evictable) even if the admission then fails."""
        loaded = 0
        if self.prefix is not None and not isinstance(tokens, (int, str, bytes)):
            try:  # a tensor / ndarray of ids, as PagedCache accepts
                toks = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
            except TypeError:
                toks = None  # the admission below raises its own error
            if toks is not None:
                tokens = toks
                if self._loadable(toks, salt, seq_id):
                    loaded = self.prefix.load(self.pool, self.layers, self.layout,
                                              self.seqs.namespace, toks, salt)
        new = super().add_sequence(tokens, salt, seq_id)
        self._changed()
        self._salt[new.seq_id] = salt
        self._chains[new.seq_id] = []
        self.tier_hit_tokens += min(loaded * self.block_size, new.hit_tokens)
        return new

    def _loadable(self, toks: list, salt: Salt, seq_id: Optional[Hashable]) -> bool:
        """Whether the admission of `toks` would be accepted (so a store lookup is worth it)."""
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63
                   for t in toks):
            return False
        if seq_id is not None and seq_id in self.seqs:
            return False
        try:
            root_hash(b"", salt)
        except TypeError:
            return False
        return True

    def allocate(self, seq_id: Hashable, tokens: Union[int, Sequence[int]]) -> torch.Tensor:
        out = super().allocate(seq_id, tokens)
        self._changed()
        return out

    def step(self, seq_ids: Sequence[Hashable], tokens: Sequence[Union[int, Sequence[int]]]
             ) -> StepBatch:
        batch = super().step(seq_ids, tokens)
        self._changed()
        if any(self._swapped.get(s) for s in seq_ids):
            batch = dataclasses.replace(batch, block_tables=self.block_tables(seq_ids))
        return batch

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Commit (see PagedCache.commit), publish newly full blocks, then enforce the resident
        cap. TierWriteError (swap full) leaves the commit done and the blocks resident."""
        if isinstance(seq_ids, (list, tuple, set, frozenset)) and seq_ids not in self.seqs:
            ids = list(seq_ids)
        else:
            ids = [seq_ids]
        super().commit(seq_ids)
        self._changed()
        if self.prefix is not None:
            for sid in ids:
                self._publish(sid)
        if self.cap is not None:
            for sid in ids:
                self.enforce_cap(sid)

    def fork(self, seq_id: Hashable, new_id: Optional[Hashable] = None) -> Hashable:
        nid = super().fork(seq_id, new_id)
        self._changed()
        sw = self._swapped.get(seq_id)
        if sw:
            self._swapped[nid] = dict(sw)
            for key in sw.values():
                self.swap.share(key)  # type: ignore[union-attr]
            self._ph_refs += len(sw)
        self._salt[nid] = self._salt.get(seq_id)
        self._chains[nid] = list(self._chains.get(seq_id, []))
        if seq_id in self._no_publish:
            self._no_publish.add(nid)
        return nid

    def pop(self, seq_id: Hashable, n: int) -> None:
        """PagedCache.pop; a swapped block that becomes the partly filled last block is read
        back first (CacheFull / SwapLost before any change if that is impossible)."""
        L = self.seqs.length(seq_id)
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= L:
            return super().pop(seq_id, n)  # raises the cache's error
        new_len = L - n
        bs = self.block_size
        keep = -(-new_len // bs)
        sw = self._swapped.get(seq_id) or {}
        sections = None
        if new_len % bs and (keep - 1) in sw:  # it becomes the partly filled last block
            table = self.seqs.table(seq_id)
            freed = sum(1 for j in range(keep, len(table))
                        if j not in sw and self.pool.ref_count(table[j]) == 1)
            if self.pool.num_available + freed < 1:
                raise CacheFull(
                    f"pop of {n} tokens from sequence {seq_id!r} must read swapped block "
                    f"{keep - 1} back and no pool block is available"
                )
            try:
                sections = self.swap.read_whole(self.layout, sw[keep - 1])  # type: ignore[union-attr]
            except SwapLost as exc:
                raise self._lost(exc, None) from None
        super().pop(seq_id, n)
        self._changed()
        for i in [i for i in sw if i >= keep]:
            self._drop_entry(seq_id, i)
        if sections is not None:
            b = self.pool.allocate_one()
            write_block(self.layers, b, sections)
            fill = getattr(self.pool, "fill", None)
            if fill is not None:
                fill[b] = new_len - (keep - 1) * bs
            table = self.seqs.table(seq_id)
            assert table[keep - 1] == self._ph
            table[keep - 1] = b
            self.pool.release(self._ph)  # the entry's reference to the placeholder
            self._drop_entry(seq_id, keep - 1)
        chains = self._chains.get(seq_id)
        if chains is not None:
            del chains[new_len // bs:]

    def reset(self, seq_id: Hashable) -> None:
        self.pop(seq_id, self.seqs.length(seq_id))

    def free(self, seq_id: Hashable) -> None:
        super().free(seq_id)
        self._changed()
        sw = self._swapped.pop(seq_id, None)
        if sw:
            for key in sw.values():
                self.swap.release(key)  # type: ignore[union-attr]
            self._ph_done(len(sw))
        self._salt.pop(seq_id, None)
        self._chains.pop(seq_id, None)
        self._no_publish.discard(seq_id)

    def clear(self) -> None:
        super().clear()
        self._changed()
        if self.swap is not None:
            self.swap.clear()
        self._swapped.clear()
        self._ph, self._ph_refs = None, 0
        self._salt.clear()
        self._chains.clear()
        self._no_publish.clear()

    def configure_layer(self, layer: int, **kw) -> None:
        super().configure_layer(layer, **kw)
        self._changed()

    # ---- swap -------------------------------------------------------------------------------
    def swapped_blocks(self, seq_id: Hashable) -> list[int]:
        """Logical indices of the sequence's blocks that are swapped out (sorted)."""
        self.seqs.length(seq_id)  # UnknownSequence if absent
        return sorted(self._swapped.get(seq_id, ()))

    def resident_blocks(self, seq_id: Hashable) -> int:
        return len(self.seqs.table(seq_id)) - len(self._swapped.get(seq_id, ()))

    def enforce_cap(self, seq_id: Hashable) -> int:
        """Swap out the sequence's oldest full committed blocks until at most `cap` are resident
        (the last block always stays). Returns how many moved; TierWriteError if a write fails
        (that block and the later ones stay resident)."""
        if self.cap is None:
            return 0
        table = self.seqs.table(seq_id)
        sw = self._swapped.setdefault(seq_id, {})
        excess = len(table) - len(sw) - self.cap
        if excess <= 0:
            return 0
        full = min(self.seqs.committed(seq_id) // self.block_size, len(table) - 1)
        moved = 0
        for i in range(full):
            if moved >= excess:
                break
            if i in sw:
                continue
            if not self._swap_out(seq_id, i):
                break
            moved += 1
        return moved

    def _swap_out(self, seq_id: Hashable, i: int) -> bool:
        """Move logical block i out (False when the pool has no block left for the
        placeholder and i's block cannot serve as one: nothing changed)."""
        table = self.seqs.table(seq_id)
        b = table[i]
        pool = self.pool
        key = self.swap.write(self.layers, self.layout, b, pool.block_hash(b))  # type: ignore[union-attr]
        if self._ph is None:
            try:
                self._ph = pool.allocate_one()  # its one reference is this entry's
            except CacheFull:
                if pool.ref_count(b) == 1 and pool.block_hash(b) is None:
                    self._ph = b  # b's own reference becomes the placeholder's
                else:
                    self.swap.release(key)  # type: ignore[union-attr]
                    return False
            else:
                pool.release(b)
        else:
            pool.share(self._ph)
            pool.release(b)
        table[i] = self._ph
        self._ph_refs += 1
        self._swapped[seq_id][i] = key
        self._changed()
        return True

    def _lost(self, exc: SwapLost, layer: Optional[int]) -> SwapLost:
        """The SwapLost a caller sees: the sequences and token ranges whose K/V is gone."""
        lost = set(exc.keys)
        bs = self.block_size
        hit = []
        for sid, sw in self._swapped.items():
            idx = sorted(i for i, key in sw.items() if key in lost)
            if idx:
                spans = ", ".join(f"{i * bs}..{(i + 1) * bs - 1}" for i in idx)
                hit.append(f"sequence {sid!r} (tokens {spans})")
        where = "" if layer is None else f" of layer {layer}"
        return SwapLost(f"K/V{where} swapped out to {self.swap.tier.name} cannot be read back "  # type: ignore[union-attr]
                        f"intact (removed or corrupted outside pagedkv) for "
                        f"{'; '.join(hit) or 'no live sequence'}: free and recompute them",
                        keys=exc.keys)

    def _drop_entry(self, seq_id: Hashable, i: int) -> None:
        """Forget swapped entry i whose placeholder reference was already released."""
        key = self._swapped[seq_id].pop(i)
        self.swap.release(key)  # type: ignore[union-attr]
        self._ph_done(1)

    def _ph_done(self, n: int) -> None:
        """n swapped entries were released through the table (pool refs already dropped)."""
        self._ph_refs -= n
        if self._ph_refs == 0:
            self._ph = None

    # ---- prefix publishing ------------------------------------------------------------------
    def _publish(self, seq_id: Hashable) -> None:
        if seq_id in self._no_publish:
            return
        bs = self.block_size
        chains = self._chains.setdefault(seq_id, [])
        full = self.seqs.committed(seq_id) // bs
        if full <= len(chains):
            return
        tokens = self.seqs.tokens(seq_id)
        table = self.seqs.table(seq_id)
        sw = self._swapped.get(seq_id, {})
        h = chains[-1] if chains else root_hash(self.seqs.namespace, self._salt.get(seq_id))
        todo: list[tuple[int, bytes]] = []
        for i in range(len(chains), full):
            toks = tokens[i * bs:(i + 1) * bs]
            if -1 in toks:
                self._no_publish.add(seq_id)
                break
            h = chain_hash(h, toks)
            chains.append(h)
            if i not in sw:  # a swapped block's data is not in the pool (published earlier)
                todo.append((table[i], h))
        self.prefix.publish_many(self.layers, self.layout, todo)  # type: ignore[union-attr]

    # ---- attention --------------------------------------------------------------------------
    def block_tables(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 [B, max_blocks], 0-padded; -1 where a block is swapped out."""
        tables = []
        for s in seq_ids:
            t = self.seqs.table(s)
            sw = self._swapped.get(s)
            if sw:
                t = array("i", t)
                for i in sw:
                    t[i] = -1
            tables.append(t)
        return block_table_tensor(tables, self.device)

    def _plan(self, seq_ids: Sequence[Hashable]) -> _Plan:
        key = (self._epoch, tuple(seq_ids))
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1]
        lens = int_tensor([self.seqs.length(s) for s in seq_ids], torch.int32, self.device)
        if not any(self._swapped.get(s) for s in seq_ids):
            plan = _Plan(block_tables=super().block_tables(seq_ids), seq_lens=lens,
                         resident=None, keys=())
        else:
            res: dict[int, int] = {}
            recs: dict[str, int] = {}
            rows = []
            for s in seq_ids:
                t = self.seqs.table(s)
                sw = self._swapped.get(s) or {}
                rows.append([(1, recs.setdefault(sw[i], len(recs))) if i in sw
                             else (0, res.setdefault(t[i], len(res))) for i in range(len(t))])
            n_res = len(res)
            tables = [array("i", [j + n_res if kind else j for kind, j in row]) for row in rows]
            plan = _Plan(block_tables=block_table_tensor(tables, self.device), seq_lens=lens,
                         resident=torch.tensor(list(res), dtype=torch.int64, device=self.device),
                         keys=tuple(recs))
        self._plan_cache = (key, plan)
        return plan

    def attention_view(self, layer: int, seq_ids: Sequence[Hashable]
                       ) -> tuple[PagedLayer, torch.Tensor, torch.Tensor]:
        """(PagedLayer, block_tables int32 [B, max_blocks], seq_lens int32 [B]) for attention of
        `seq_ids` in `layer`: the real layer when nothing is swapped, else a temporary layer
        whose pools hold the batch's resident blocks then its swapped blocks read back (the same
        bytes, so any attention op gives the same result). Raises SwapLost if a swapped block
        cannot be read back intact."""
        pl = self._layer(layer)
        plan = self._plan(seq_ids)
        if not plan.keys:
            return pl, plan.block_tables, plan.seq_lens
        try:
            got = self.swap.read_layer(self.layout, layer, plan.keys)  # type: ignore[union-attr]
        except SwapLost as exc:
            raise self._lost(exc, layer) from None
        n_res, n_sw = int(plan.resident.numel()), len(plan.keys)
        pools = []
        for side, pool in ((0, pl.k_pool), (1, pl.v_pool)):
            tmp = torch.empty(n_res + n_sw, pool.shape[1], dtype=torch.uint8, device=pool.device)
            if n_res:
                tmp[:n_res] = pool[plan.resident]
            raw = bytearray().join(item[side] for item in got)
            tmp[n_res:] = torch.frombuffer(raw, dtype=torch.uint8).view(n_sw, -1).to(pool.device)
            pools.append(tmp)
        return dataclasses.replace(pl, k_pool=pools[0], v_pool=pools[1]), plan.block_tables, \
            plan.seq_lens

    def decode_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                         params: AttentionParams, **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.decode_attention` of q float [B, Hq, D] over `seq_ids` in `layer`,
        reading swapped blocks back. Returns [B, Hq, D]."""
        pl, tables, lens = self.attention_view(layer, seq_ids)
        return ops.decode_attention(q, pl, tables, lens, params, **op_kwargs)

    def prefill_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                          query_start_loc: torch.Tensor, params: AttentionParams,
                          **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.prefill_attention` of packed q float [Tq, Hq, D] (new tokens already
        stored) over `seq_ids` in `layer`, reading swapped blocks back. Returns [Tq, Hq, D]."""
        pl, tables, lens = self.attention_view(layer, seq_ids)
        return ops.prefill_attention(q, pl, tables, lens, query_start_loc, params, **op_kwargs)

    def gather(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K, V (float32 [len, H, D]) of a sequence in `layer`, swapped blocks included."""
        if not self._swapped.get(seq_id):
            return super().gather(layer, seq_id)
        pl, tables, lens = self.attention_view(layer, [seq_id])
        n, bs = int(lens[0]), self.block_size
        pos = torch.arange(n, device=self.device)
        slots = tables[0].long()[pos // bs] * bs + pos % bs
        return storage.gather_side(pl, "k", slots), storage.gather_side(pl, "v", slots)

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: Optional[int] = None
                     ) -> torch.Tensor:
        sw = self._swapped.get(seq_id)
        if sw:
            n = self.seqs.length(seq_id)
            e = n if end is None else end
            if isinstance(start, int) and isinstance(e, int) and 0 <= start <= e <= n:
                bs = self.block_size
                hit = [i for i in sw if i * bs < e and (i + 1) * bs > start]
                if hit:
                    raise ConfigError(
                        f"positions [{start}, {e}) of sequence {seq_id!r} include swapped-out "
                        f"blocks {sorted(hit)}; use attention_view / gather to read them"
                    )
        return super().slot_mapping(seq_id, start, end)

    # ---- reporting / lifetime -----------------------------------------------------------------
    def offload_stats(self) -> dict:
        """Counters of the tiers: swap (outs, ins, bytes, read time) and prefix store."""
        out: dict = {"tier_hit_tokens": self.tier_hit_tokens,
                     "swapped_blocks": sum(len(m) for m in self._swapped.values())}
        if self.swap is not None:
            out["swap"] = dataclasses.asdict(self.swap.stats)
            out["swap_tier"] = self.swap.tier.stats.snapshot()
        if self.prefix is not None:
            out["prefix"] = dataclasses.asdict(self.prefix.stats)
            out["prefix_tier"] = self.prefix.tier.stats.snapshot()
        return out

    def close(self) -> None:
        """Delete this cache's swap records (and directory) and close the tiers."""
        self._finalizer()

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
