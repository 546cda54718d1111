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

`cache.layers[i]` is the `PagedLayer` ops consume. `commit` is what makes a full block findable
by later prefix lookups; a block is never keyed before its K/V were stored in every layer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Hashable, Iterable, Optional, Sequence, Union

import torch

from ..alloc import BlockPool, SequenceManager
from ..alloc.hashing import Salt
from ..alloc.trace import BlockTrace
from ..errors import ConfigError, InvalidInput
from ..ops.batch import PagedLayer
from . import storage
from .config import CacheConfig
from .tables import StepBatch, block_table_tensor, int_tensor

try:  # the public op (validation + backend dispatch); the fallback keeps the cache usable alone
    from ..ops import store as _ops_store
except ImportError:  # pragma: no cover - only while ops are being built
    _ops_store = None


@dataclass(frozen=True)
class NewSequence:
    """Result of `add_sequence`: the id, how many leading tokens were prefix hits (already stored
    and committed), and int64 [len(tokens) - hit_tokens] slots for the rest."""

    seq_id: Hashable
    hit_tokens: int
    slot_mapping: torch.Tensor


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


class PagedCache:
    """Paged KV storage for every attention layer of one model.

    layers: tuple of PagedLayer (index = cache layer). Sequence ids are any hashable value given
    by the caller, or ints handed out by `add_sequence`/`fork`.
    """

    def __init__(self, config: CacheConfig):
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"PagedCache needs a CacheConfig, got {type(config).__name__}")
        if config.latent is not None:  # latent (MLA) layers have one pool, not K/V pools
            raise ConfigError("PagedCache stores K/V layers; latent (MLA) layouts are served by "
                              "pagedkv.integrations.deepseek.PagedLatentCache and pagedkv.ops.latent")
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.total_blocks
        self.device = config.device
        self.pool = BlockPool(self.num_blocks, trace=config.trace)
        self.seqs = SequenceManager(self.pool, config.block_size, config.fingerprint)
        self.layers: tuple[PagedLayer, ...] = storage.build_layers(config)
        self._checked: tuple = (None, -1, -1)  # (slot tensor, its _version, pool.version)

    # ---- sequences ------------------------------------------------------------------------
    def add_sequence(self, tokens: Sequence[int], salt: Salt = None,
                     seq_id: Optional[Hashable] = None) -> NewSequence:
        """Admit a prompt. Full blocks whose keys (token chain + salt + cache fingerprint) are
        cached are shared instead of recomputed; hits are whole blocks and always fewer than
        len(tokens). Store K/V of `tokens[hit_tokens:]` at `slot_mapping`, then `commit`."""
        sid, hit, slots = self.seqs.add(tokens, salt, seq_id)
        return NewSequence(sid, hit, int_tensor(slots, torch.int64, self.device))

    def allocate(self, seq_id: Hashable, tokens: Union[int, Sequence[int]]) -> torch.Tensor:
        """Slots (int64 [n]) for new tokens at the end of a sequence: their ids, or a count when
        the ids are unknown (such blocks are never prefix-keyed). A shared partly filled last
        block is copied first, in every layer."""
        slots, copies = self.seqs.allocate(seq_id, tokens)
        storage.copy_blocks(self.layers, copies)
        return int_tensor(slots, torch.int64, self.device)

    def step(self, seq_ids: Sequence[Hashable], tokens: Sequence[Union[int, Sequence[int]]]
             ) -> StepBatch:
        """Allocate new tokens for several sequences at once (all or nothing) and build the
        step's tensors: slot mapping, block tables, seq_lens, query_start_loc."""
        slots, copies = self.seqs.allocate_batch(seq_ids, tokens)
        storage.copy_blocks(self.layers, copies)
        seqs = self.seqs
        lens = [seqs.length(i) for i in seq_ids]
        starts = [0]
        for t in tokens:
            starts.append(starts[-1] + (t if isinstance(t, int) else len(t)))
        return StepBatch(
            slot_mapping=int_tensor(slots, torch.int64, self.device),
            block_tables=block_table_tensor([seqs.table(i) for i in seq_ids], self.device),
            seq_lens=int_tensor(lens, torch.int32, self.device),
            query_start_loc=int_tensor(starts, torch.int32, self.device),
        )

    def commit(self, seq_ids: Union[Hashable, Iterable[Hashable]]) -> None:
        """Declare every allocated token's K/V stored in every layer (one id or a list); full
        blocks are then keyed for prefix hits."""
        self.seqs.commit(seq_ids)

    def fork(self, seq_id: Hashable, new_id: Optional[Hashable] = None) -> Hashable:
        """A copy of a sequence sharing all its blocks (beam search, parallel sampling)."""
        return self.seqs.fork(seq_id, new_id)

    def pop(self, seq_id: Hashable, n: int) -> None:
        """Drop the last n tokens (rejected speculative tokens); empty blocks are released."""
        self.seqs.pop(seq_id, n)

    def reset(self, seq_id: Hashable) -> None:
        """Empty a sequence, keeping its id."""
        self.seqs.reset(seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Drop a sequence; its committed full blocks stay cached for prefix hits (LRU)."""
        self.seqs.free(seq_id)

    def clear(self) -> None:
        """Drop every sequence and every cached prefix (the pools keep their bytes)."""
        self.seqs.clear()

    def reset_prefix_cache(self) -> int:
        """Forget all prefix keys; cached blocks return to the free list. Returns how many."""
        return self.pool.reset_prefix_cache()

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

    def block_tables(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 [B, max_blocks], 0-padded."""
        return block_table_tensor([self.seqs.table(i) for i in seq_ids], self.device)

    def seq_lens(self, seq_ids: Sequence[Hashable]) -> torch.Tensor:
        """int32 [B]."""
        return int_tensor([self.seqs.length(i) for i in seq_ids], torch.int32, self.device)

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: Optional[int] = None
                     ) -> torch.Tensor:
        """int64 [end - start]: slots of positions start..end-1 of a sequence."""
        n = self.seqs.length(seq_id)
        end = n if end is None else end
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise ConfigError(f"positions [{start}, {end}) are outside sequence {seq_id!r} of {n}")
        return int_tensor(self.seqs._slots(self.seqs._get(seq_id), start, end - start),
                          torch.int64, self.device)

    @property
    def trace(self) -> Optional[BlockTrace]:
        """Per-block events (None unless CacheConfig(trace=True))."""
        return self.pool.trace

    def stats(self) -> CacheStats:
        layer_bytes = tuple((pl.k_pool.numel() * pl.k_pool.element_size(),
                             pl.v_pool.numel() * pl.v_pool.element_size()) for pl in self.layers)
        s = self.seqs
        q = s.prefix_query_tokens
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_free=self.pool.num_free,
            blocks_used=self.pool.num_used,
            blocks_cached=self.pool.num_cached,
            num_sequences=len(s),
            tokens_stored=sum(s.length(i) for i in s.ids()),
            bytes_per_block=self.config.bytes_per_block,
            layer_bytes=layer_bytes,
            total_bytes=sum(k + v for k, v in layer_bytes),
            prefix_queries=s.prefix_queries,
            prefix_query_tokens=q,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_hit_rate=(s.prefix_hit_tokens / q) if q else 0.0,
            evictions=self.pool.evictions,
        )

    # ---- data -----------------------------------------------------------------------------
    def _layer(self, layer: int) -> PagedLayer:
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(self.layers):
            raise ConfigError(f"layer must be an int in [0, {len(self.layers)}), got {layer!r}")
        return self.layers[layer]

    def _check_slots(self, slot_mapping: torch.Tensor) -> None:
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype != torch.int64 \
                or slot_mapping.dim() != 1:
            raise InvalidInput(
                f"slot_mapping must be an int64 [T] tensor, got "
                f"{getattr(slot_mapping, 'dtype', type(slot_mapping).__name__)} "
                f"{list(getattr(slot_mapping, 'shape', []))}"
            )
        last, tv, pv = self._checked
        if last is slot_mapping and tv == slot_mapping._version and pv == self.pool.version:
            return  # the same, unmodified tensor was checked for an earlier layer of this step
        s = slot_mapping.detach().cpu()
        s = s[s >= 0]
        if not s.numel():
            return
        bs = self.block_size
        hi = int(s.max())
        if hi >= self.num_blocks * bs:
            raise InvalidInput(f"slot {hi} is outside the pool ({self.num_blocks} blocks x {bs})")
        blocks, offs = s // bs, s % bs
        in_use = torch.frombuffer(self.pool.in_use, dtype=torch.uint8)
        fill = torch.frombuffer(self.pool.fill, dtype=torch.int32)  # zero-copy view
        bad = (in_use[blocks] == 0) | (offs >= fill[blocks].long())
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise InvalidInput(
                f"slot {int(s[i])} (block {int(blocks[i])}, offset {int(offs[i])}) was not "
                "allocated to any sequence; store only at slots returned by add_sequence, "
                "allocate or step"
            )
        keyed = torch.frombuffer(self.pool.keyed, dtype=torch.uint8)[blocks]
        if bool(keyed.any()):
            i = int(keyed.nonzero()[0, 0])
            raise InvalidInput(
                f"slot {int(s[i])} is in block {int(blocks[i])}, a committed prefix block that "
                "other sequences may share; its K/V are already stored (store only the tokens "
                "after NewSequence.hit_tokens)"
            )
        if torch.unique(s).numel() != s.numel():
            raise InvalidInput("slot_mapping holds the same slot twice")
        self._checked = (slot_mapping, slot_mapping._version, self.pool.version)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Encode k, v (float [T, H, D]) into layer `layer`'s pools at `slot_mapping` (int64 [T],
        negative = skip). Slots must have been allocated (checked unless config.check_slots is
        False). Raises before writing anything."""
        pl = self._layer(layer)
        if self.config.check_slots:
            self._check_slots(slot_mapping)
        if _ops_store is not None:
            _ops_store(pl, k, v, slot_mapping)
        else:  # pragma: no cover
            storage.store_fallback(pl, k, v, slot_mapping)

    def gather(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a sequence's stored K and V in `layer`: float32 [len, H, D] each, in the
        original (unrotated, uncentred) basis. For tests and the reference attention."""
        pl = self._layer(layer)
        slots = self.slot_mapping(seq_id)
        return storage.gather_side(pl, "k", slots), storage.gather_side(pl, "v", slots)

    def configure_layer(self, layer: int, *, k_scale: Optional[float] = None,
                        v_scale: Optional[float] = None,
                        k_centre: Optional[torch.Tensor] = None) -> None:
        """Set a layer's fp8 tensor scales and/or key centre (float32 [H, D]; needs
        CacheConfig(key_centring=True)). Only while the cache holds no data (they change what
        stored bytes mean)."""
        pl = self._layer(layer)
        if self.pool.num_used or self.pool.num_cached:
            raise ConfigError(
                "configure_layer needs an empty cache (stored blocks were encoded with the old "
                "settings); call clear() first"
            )
        for name, val in (("k_scale", k_scale), ("v_scale", v_scale)):
            if val is not None and not (isinstance(val, (int, float)) and 0 < float(val) < float("inf")):
                raise ConfigError(f"{name} must be a finite number > 0, got {val!r}")
        changes = {}
        if k_centre is not None:
            if not self.config.key_centring:
                raise ConfigError("k_centre needs CacheConfig(key_centring=True)")
            shape = (pl.num_kv_heads, pl.head_dim)
            if not isinstance(k_centre, torch.Tensor) or tuple(k_centre.shape) != shape \
                    or not torch.is_floating_point(k_centre) or not bool(torch.isfinite(k_centre).all()):
                raise InvalidInput(f"k_centre must be a finite float tensor of shape {list(shape)}")
            changes["k_centre"] = k_centre.detach().to(self.device, torch.float32).clone()
        if k_scale is not None:
            changes["k_scale"] = torch.tensor([float(k_scale)], dtype=torch.float32, device=self.device)
        if v_scale is not None:
            changes["v_scale"] = torch.tensor([float(v_scale)], dtype=torch.float32, device=self.device)
        if changes:
            layers = list(self.layers)
            layers[layer] = dataclasses.replace(pl, **changes)
            self.layers = tuple(layers)
