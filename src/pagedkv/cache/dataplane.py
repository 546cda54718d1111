"""The data plane of the engine cache, per layer: store (after the slot check), attention on the
pools (through a view with swapped blocks read back when the tiers swapped some), gather (tests
and oracles) and the layer transform. Mixed into `PagedCache`.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Optional, Sequence

import torch

from ..errors import ConfigError, InvalidInput
from ..ops import api as ops
from ..ops.batch import AttentionParams, PagedLayer
from . import storage


class DataPlane:
    """Store / attend / gather of `PagedCache` (see the module doc)."""

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
        ops.store(pl, k, v, slot_mapping)

    # ---- attention ----------------------------------------------------------------------------
    def attention_view(self, layer: int, seq_ids: Sequence[Hashable]
                       ) -> tuple[PagedLayer, torch.Tensor, torch.Tensor]:
        """(PagedLayer, block_tables int32 [B, max_blocks], seq_lens int32 [B]) for attention of
        `seq_ids` in `layer`: the layer itself and the cache's tables when nothing of the batch
        is swapped, else a temporary layer whose pools hold the batch's resident blocks then its
        swapped blocks read back (the same bytes, so any attention op gives the same result).
        Raises SwapLost, naming the sequences and tokens, if a swapped block is not intact."""
        pl = self._layer(layer)
        lens = self.seq_lens(seq_ids)
        got = None if self.tiers is None else self.tiers.view(
            self.seqs, self.layers, layer, seq_ids, self._epoch, self.device)
        if got is None:
            return pl, self.block_tables(seq_ids), lens
        return got[0], got[1], lens

    def decode_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                         params: AttentionParams, **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.decode_attention` of q float [B, Hq, D] over `seq_ids` in `layer`
        (swapped blocks read back). Returns [B, Hq, D]."""
        pl, tables, lens = self.attention_view(layer, seq_ids)
        return ops.decode_attention(q, pl, tables, lens, params, **op_kwargs)

    def prefill_attention(self, layer: int, q: torch.Tensor, seq_ids: Sequence[Hashable],
                          query_start_loc: torch.Tensor, params: AttentionParams,
                          **op_kwargs) -> torch.Tensor:
        """`pagedkv.ops.prefill_attention` of packed q float [Tq, Hq, D] (new tokens already
        stored) over `seq_ids` in `layer` (swapped blocks read back). Returns [Tq, Hq, D]."""
        pl, tables, lens = self.attention_view(layer, seq_ids)
        return ops.prefill_attention(q, pl, tables, lens, query_start_loc, params, **op_kwargs)

    def gather(self, layer: int, seq_id: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a sequence's stored K and V in `layer` (swapped blocks included): float32
        [len, H, D] each, in the original basis (transform undone). For tests and oracles."""
        pl, tables, lens = self.attention_view(layer, [seq_id])
        n, bs = int(lens[0]), self.block_size
        pos = torch.arange(n, device=self.device)
        slots = tables[0].long()[pos // bs] * bs + pos % bs
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
            self._changed()
