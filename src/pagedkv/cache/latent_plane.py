"""The data plane of the engine cache for latent (MLA) layers: `PagedCache` holds one
(`cache.latent_plane`) next to its `DataPlane` (K/V layers), whose slot checks and attention
views it calls.

With `CacheConfig(latent=LatentLayout(...))` every layer is a `LatentLayer` (one pool of
`[latent | rope]` rows, `ops.latent_layer`) built by the one builder (`storage.build_layer`).
Everything above the data plane is the same as for K/V layers: sequences, prefix hits, fork,
pop, block groups (a latent layer is one member of its group; sliding windows work as for K/V),
the resident cap and the prefix store (a latent layer's record is its whole pool block,
`storage.record_member`). Per layer:

- `store_latent(layer, latent [T, L], rope [T, R], slots)`: the StepBatch / NewSequence that
  handed the slots out (or an int64 [T] slot tensor), checked as `store` checks them. A layer's
  first store fits its fp8 tensor scales from that chunk (`cache.latent.fit_latent_scales`, as
  the drop-in `PagedLatentCache` does; nothing for other codecs; kept as they are when blocks
  were loaded from a prefix store first).
- fp8 scales and a shared prefix store: the scales are in the records' layout (`offload.record`)
  and so in the block keys: a block written under other scales is a plain miss. The first cache
  to commit publishes its scales as the store's transform record (`transform_record.
  SharedTransform`, the drop-ins' mechanism); a cache that has fixed no scale and holds no
  block adopts them at its first `add_sequence` (`cache/transforms.py`), so its lookups hit
  what the publisher stored and give what recomputing with those scales gives. A cache that
  fitted its own scales first keeps them: the store's blocks then miss (never a wrong read).
- `latent_decode_attention` / `latent_prefill_attention`: `pagedkv.ops.latent`'s ops over the
  sequences' pages (swapped blocks read back through `attention_view`).
- `gather_latent(layer, seq_id)`: the stored rows decoded (tests, oracles).

The K/V methods (`store`, `decode_attention`, ...) refuse a latent layer and these refuse a K/V
layer, each with a ConfigError naming the other.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import torch

from ..errors import ConfigError
from ..ops.batch import AttentionParams
from ..ops.latent import (check_latent_store, latent_decode_attention, latent_prefill_attention,
                          latent_store)
from ..ops.latent_layer import LatentLayer
from . import storage
from .latent import fit_latent_scales


class LatentPlane:
    """Store / attend / gather of one `PagedCache`'s latent layers (see the module doc), on the
    cache's K/V plane `kv` (slot checks, views), storage and transforms."""

    def __init__(self, kv):
        self.kv, self.storage, self.transforms = kv, kv.storage, kv.transforms

    def _latent(self, layer: int) -> LatentLayer:
        pl = self.kv.layer(layer)
        if not isinstance(pl, LatentLayer):
            raise ConfigError(f"layer {layer} stores K/V: use store / decode_attention / "
                              "prefill_attention / gather (the latent methods need "
                              "CacheConfig(latent=LatentLayout(...)))")
        return pl

    def store_latent(self, layer: int, latent: torch.Tensor, rope: torch.Tensor,
                     slot_mapping, **op_kwargs) -> None:
        """Encode the new tokens' latent float [T, L] (after the KV layernorm) and rope key
        float [T, R] (after RoPE) into layer `layer` at the slots `slot_mapping` names (the
        StepBatch / NewSequence, or int64 [T] slots of the layer's group; negative = skip).
        The layer's first store fixes its fp8 tensor scales from this chunk. Raises before
        anything is written (InvalidInput for bad tensors or slots)."""
        pl = self._latent(layer)
        slots, _ = self.kv.store_slots(layer, slot_mapping)
        # blocks loaded from a prefix store before the first store were written with today's
        # scales (adopted from the store, or the defaults): then they stay
        tr = self.transforms
        fit = layer not in tr.fitted and not any(any(g.pool.keyed) for g in self.storage.core.groups)
        if fit:  # check the input (nothing fitted on bad input), fix the scales, then write once
            check_latent_store(pl, latent, rope, slots, op_kwargs.get("checks", True))
            changes = fit_latent_scales(pl.spec, latent, rope, pl.device)
            if changes:
                pl = dataclasses.replace(pl, **changes)
                self.storage.set_layers({layer: pl})
            op_kwargs = dict(op_kwargs, checks=False)  # checked just now
        tr.fitted = tr.fitted | {layer}
        latent_store(pl, latent, rope, slots, **op_kwargs)

    def latent_decode_attention(self, layer: int, q_lat: torch.Tensor, q_rope: torch.Tensor,
                                seq_ids: Sequence[Hashable], params: AttentionParams,
                                **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.latent.latent_decode_attention` of q_lat float [B, Hq, L], q_rope
        [B, Hq, R] (absorbed, RoPE applied; one query per sequence) over `seq_ids` in `layer`.
        Returns [B, Hq, L]."""
        self._latent(layer)
        self.kv.check_window(layer, params)
        pl, tables, lens = self.kv.attention_view(layer, seq_ids)
        return latent_decode_attention(q_lat, q_rope, pl, tables, lens, params, **op_kwargs)

    def latent_prefill_attention(self, layer: int, q_lat: torch.Tensor, q_rope: torch.Tensor,
                                 seq_ids: Sequence[Hashable], query_start_loc: torch.Tensor,
                                 params: AttentionParams, **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.latent.latent_prefill_attention` of packed q_lat [Tq, Hq, L], q_rope
        [Tq, Hq, R] (the new tokens already stored) over `seq_ids` in `layer`. Returns
        [Tq, Hq, L]."""
        self._latent(layer)
        self.kv.check_window(layer, params)
        pl, tables, lens = self.kv.attention_view(layer, seq_ids)
        return latent_prefill_attention(q_lat, q_rope, pl, tables, lens, query_start_loc, params,
                                        **op_kwargs)

    def gather_latent(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a sequence's stored rows in `layer` (swapped blocks included): (latent float32
        [len, L], rope float32 [len, R]), unrotated; NaN rows where a sliding window released
        the block. For tests and oracles."""
        self._latent(layer)
        pl, tables, _ = self.kv.attention_view(layer, [seq_id])
        slots, released = storage.sequence_rows(tables[0], self.storage.group(self.storage.group_of(layer)).table(seq_id),
                                                self.storage.core.main.length(seq_id), self.kv.block_size,
                                                self.storage.device)
        row = torch.cat([storage.gather_side(sec, "k", slots)[:, 0] for sec in pl.sections()], -1)
        row = row.masked_fill(released[:, None], float("nan"))
        return row[:, :pl.latent_dim], row[:, pl.latent_dim:]
