"""Hugging Face transformers (5.x) drop-in: a `Cache` whose layers hold K/V compressed in pages,
and an attention function that computes attention directly on those pages.

Usage:

    from pagedkv.integrations.transformers import PagedKVCache, register
    register()                                   # adds attn_implementation="pagedkv"
    model.set_attn_implementation("pagedkv")     # or from_pretrained(..., attn_implementation="pagedkv")
    cache = PagedKVCache(model, "turbo3")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)   # or cache=cache

How it works. The mask function registered for "pagedkv" turns a 2D attention_mask into a small
`PaddingMask` (causality and windows are applied inside the ops). Each layer's `update(k, v,
layer_idx)` only takes the new tokens' K/V (float [B, H, T, D]), tagged with the layer; the
registered attention function, which receives the mask, stores the chunk's valid tokens and
attends (every query, a prompt's too, reads compressed K/V, as in decoding). Without a
PagedKVCache it computes exact fp32 attention on the K/V it is given (pads masked).

Storage is the engine cache's (`pagedkv.cache.PagedCache`, the one data plane): each batch row
is one of its sequences, the first layer of a chunk to store asks it for the step of every
block group (window reclaim, growth, compaction, copy-on-write: all or nothing, CacheFull before
any change), each layer fits its transform on its first chunk (key centre and multipliers, value
centre, fp8 scales: `PagedCache.fit_layer`), stores and attends through it; a crop is a pop, a
beam reorder / repeat / select is fork and free, `begin` admits prompts with prefix hits. This
class keeps only what transformers' Cache contract needs: `update` and the column-to-token map
of padded rows (`padding.ColumnMap`: pad columns are never stored, row r holds only its valid
tokens, pad queries output zeros; `get_seq_length()` counts columns, pads included,
`row_lengths(columns)` each row's stored tokens). A sliding group releases a row's blocks
wholly before n - W + 1 before a chunk is stored at n.., so a crop can go back to the start of
the last chunk (`crop_limit`); `reclaim_sliding=False` keeps every token. Pools grow by
doubling unless `max_tokens` caps them (CacheFull, raised before any block is taken).

Limitations: `torch.compile` is not supported; a prepared 4D attention mask is refused (pass
the 2D padding mask); the mask must cover every column seen so far ([B, past + new], as
`generate` passes it; a mask that disagrees with what the cache stored raises InvalidInput);
custom mask functions (bidirectional image-token masks, packed sequences) are not applied.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..cache.config import CacheConfig
from ..cache.paged import PagedCache
from ..errors import ConfigError, InvalidInput
from ..formats import KVFormat
from ..options import CacheOptions
from ..spec import spec_and_arguments
from .hf_attention import enable, paged_attention_forward, register
from .hf_common import (ATTN_IMPLEMENTATION, GroupView, _concrete_class, _engine_fields, _layer_layout, _transformers,
                        _watch_input_ids)
from .hf_layer import PagedCacheLayer
from .batch_rows import BatchRows

__all__ = ["PagedKVCache", "PagedCacheLayer", "GroupView", "register", "enable",
           "paged_attention_forward", "ATTN_IMPLEMENTATION"]


class PagedKVCache:  # the transformers base class is mixed in lazily, see __new__
    """A transformers `Cache` storing K/V compressed in pages (see the module docstring).

    model_or_config: the model (its `.config` is used) or a HF config.
    kv_format: a spec (`pagedkv.spec`), or one format per layer. A spec means what it means on
    the command line and in vLLM: "turbo3" is turbo3 in every layer (5040 B/token on SmolLM2);
    "turbo3+hp" adds the automatic first/last high-precision layers (3+3 q8_0: 6480 B/token),
    "turbo3+hp2" two at each end; "turbo3+r64s16q8_0" adds a recent window (as
    recent_window=RecentWindow(64, "q8_0", sinks=16)); "plan.json" is a `pagedkv tune` plan.
    high_precision_layers: the same policy as an argument (N, or "auto": N from the K codec,
    see `pagedkv.cache.config`); None (default) = what the name says.
    options: a `pagedkv.options.CacheOptions`, or its fields as keywords (block_size, hp_format,
    key_centring, value_centring, key_scaling, reclaim_sliding, keep_window_prefixes,
    recent_window, approx, backend, checks; each field's help is there, the defaults derive from
    the codecs' traits), the keywords replacing the options' fields. The layer transform they
    choose is fitted to each layer's first chunk (`cache.calibration`); value_centring=True
    refuses layers with sinks (their weight takes no value, so a centre is not exact).
    max_tokens: None grows the pools on demand; an int caps every block group at that many
    tokens summed over rows (CacheFull beyond, raised before any change): the global layers'
    pools are allocated at that size, sliding-window layers' pools start small and grow up to
    it (a row holds its last W tokens plus the chunk being stored, so an all-sliding model
    decodes any length within max_tokens >= rows x (W + chunk + 2 blocks)).
    device: where the pools live (default: the model's device, else cpu).
    offload / swap_tier / prefix_tier: the engine's tiers (`pagedkv.offload.OffloadConfig`: a
    resident cap per row with swap, a shared prefix store; `begin(ids)` takes the hits).
    keep_window_prefixes (an option): sliding-window and recent-window (tail) pools keep the
    blocks the window released while they stay cached, so `begin` hits as long a prefix as
    without the window; their memory is then not returned (`CacheConfig.keep_window_prefixes`).

    Padded batches: `get_seq_length()` counts columns (pads included, what transformers'
    generate expects); row r stores only its valid tokens, `row_lengths(columns)[r]` of them.
    """

    _pagedkv_rows = True  # the forward pre-hook hands it the input_ids (`hf_common._note_input_ids`)

    def __init__(self, model_or_config, kv_format: Union[str, KVFormat, Sequence] = "turbo3", *,
                 high_precision_layers: Union[None, int, str] = None, max_tokens: Optional[int] = None,
                 device=None, check_attn_implementation: bool = True, offload=None, swap_tier=None,
                 prefix_tier=None, options: Optional[CacheOptions] = None, **option_fields):
        config = getattr(model_or_config, "config", model_or_config)
        opts = CacheOptions.of(options, **option_fields)  # ConfigError before anything is built
        spec = spec_and_arguments(kv_format, high_precision_layers, opts.recent_window)  # one parser
        self.recent_window = spec.recent_window
        if check_attn_implementation and hasattr(model_or_config, "config"):
            impl = getattr(config, "_attn_implementation", None)
            if impl != ATTN_IMPLEMENTATION:
                raise ConfigError(
                    f"the model runs attn_implementation={impl!r}; PagedKVCache needs "
                    f"{ATTN_IMPLEMENTATION!r}: call pagedkv.integrations.transformers.register() then "
                    f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r})"
                )
        types, windows, kv_heads, head_dims = _layer_layout(config)
        cache_config = CacheConfig(num_layers=len(types), num_kv_heads=kv_heads[0], head_dim=head_dims[0],
                                   layer_dims=list(zip(kv_heads, head_dims)), kv_format=spec,
                                   sliding_window=windows,
                                   **_engine_fields(model_or_config, opts, max_tokens, device, offload))
        self._open(model_or_config, cache_config, opts, PagedCacheLayer, offload, swap_tier, prefix_tier)

    def __new__(cls, *args, **kwargs):
        # Subclass transformers' Cache lazily so importing pagedkv never imports transformers.
        _, cache_utils = _transformers()
        concrete = _concrete_class(cls, cache_utils.Cache)
        return object.__new__(concrete)

    def _open(self, model, config: CacheConfig, opts: CacheOptions, layer_class, offload, swap_tier,
              prefix_tier) -> None:
        """The engine cache of `config` (the one data plane; its tiers with `offload`), the views
        of its block groups, the rows, and transformers' Cache over `layer_class` layers."""
        self.config, self.options, self.key_centring = config, opts, config.key_centring
        self.approx, self.backend, self.checks = opts.approx, opts.backend, opts.checks
        tiers = {} if offload is None else dict(offload=offload, swap_tier=swap_tier, prefix_tier=prefix_tier)
        self.engine = PagedCache(self.config, fit_first_chunk=True, **tiers)
        self.rows = BatchRows(self.engine)  # batch rows <-> the engine's sequences, columns
        layout = self.engine.groups
        self.groups = [GroupView(self.engine.core, self.rows, i, w, [j for kind, j in m if kind == "main"],
                                 [j for kind, j in m if kind == "tail"])
                       for i, (w, m) in enumerate(zip(layout.windows, layout.members))]
        self.blocks = self.groups[0]  # the global group (the first sliding one when all slide)
        self.tail_group = None if layout.tail_group is None else self.groups[layout.tail_group]
        self._group_of = {i: g for g in self.groups for i in g.layers}
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        layers = [layer_class(self, spec) for spec in self.config.layers]
        _, cache_utils = _transformers()
        cache_utils.Cache.__init__(self, layers=layers)
        _watch_input_ids(model)

    @property
    def core(self):
        """The engine's block manager (tests, accounting)."""
        return self.engine.core

    @property
    def tiers(self):
        """The engine's offload tiers (None without offload=)."""
        return self.engine.tiers

    @property
    def _rows(self) -> list:
        """The engine's sequence id of each batch row."""
        return self.rows.ids

    @property
    def batch_rows(self) -> int:
        return len(self.rows)

    def row_lengths(self, columns: int) -> list[int]:
        """Tokens each row has stored once the first `columns` columns of the batch are processed:
        pad columns (attention_mask 0) are never stored, so a row holds only its valid tokens."""
        return self.rows.lengths(columns)

    def begin(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
              reuse: bool = True) -> int:
        """Start a new batch reusing this cache's stored prefixes: call before
        `model.generate(input_ids, past_key_values=cache)` (or `cache=cache`). The previous rows
        are dropped (their committed full blocks stay cached); each new row takes the longest
        run of whole blocks its prompt shares with what the cache stored before (the same run
        for every row, always leaving one token to compute, none for padded rows), brought up
        from a prefix store first. Returns the hit tokens: `generate` then computes only the
        rest. input_ids int [B, T]; attention_mask [B, T] or None; reuse=False starts the batch
        without prefix hits (the layers keep their statistics)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InvalidInput(f"begin needs input_ids int [batch, tokens], got "
                               f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        self._flush()
        prompts = input_ids.detach().cpu().tolist()
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        hit = self.rows.begin(prompts, reuse and not padded) * self.config.block_size
        for layer in self.layers:
            layer.length = hit
            layer.pending = None
        self.prefix_hit_tokens += hit * len(prompts)
        self.prefix_query_tokens += sum(len(p) for p in prompts)
        return hit

    def _flush(self) -> None:
        for layer in self.layers:
            layer.flush()

    def _rearrange_rows(self, sources: Sequence[int]) -> None:
        self._flush()
        self.rows.rearrange(sources)

    # ---- transformers Cache API ---------------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rearrange_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rearrange_rows([r for r in range(self.batch_rows) for _ in range(int(repeats))])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rearrange_rows([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """n <= 0 removes the last -n columns (crop(0) changes nothing: transformers' assisted
        decoding calls it when every candidate was accepted); n > 0 keeps the first n columns
        (the legacy form). Columns count pads as HF does (`get_seq_length`); each row keeps its
        valid tokens among the kept columns (the engine pops the rest, reading a swapped new
        last block back). With sliding layers that released blocks, keeping fewer than
        `crop_limit()` columns (but more than 0) raises InvalidInput before any change."""
        self._flush()
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, length)
        keep = max(keep, 0)
        self.rows.crop(keep, min(keep, max((layer.length for layer in self.layers), default=0)))
        for layer in self.layers:
            layer.length = min(layer.length, keep)

    def crop_limit(self) -> int:
        """The fewest columns `crop` can keep (0 without sliding layers): sliding-window layers
        release the blocks no query at or after the start of the last stored chunk can see, so a
        crop may go back to that start (always enough for assisted / speculative decoding, which
        crops only tokens of the last forward), or to 0 columns (every token dropped)."""
        return self.rows.crop_limit()

    def reset(self) -> None:
        """Drop every row, every stored prefix and every layer's statistics."""
        self.rows.reset()
        for layer in self.layers:
            layer.reset()

    def offload_stats(self) -> dict:
        """Swapped blocks now, and the swap and prefix tiers' counters."""
        if self.engine.tiers is None:
            return {"swapped_blocks": 0}
        return self.engine.tiers.stats(self.rows.ids)

    def close(self) -> None:
        """Delete this cache's swap records and close its tiers."""
        self.engine.close()

    # ---- memory accounting ------------------------------------------------------------------
    def pool_bytes(self) -> int:
        """Bytes of every layer's K and V pools as allocated now (plus fp8 scales / centres)."""
        return sum(layer.pool_bytes() for layer in self.layers)

    def group_bytes_per_block(self, group: "GroupView") -> int:
        """Bytes one block id of `group` takes over its layers' K and V blocks and the
        recent-window tails it holds (`PagedCache.block_bytes`)."""
        return self.engine.block_bytes(group.index)

    def used_bytes(self) -> int:
        """Bytes of the blocks rows hold now, every group (released sliding blocks not counted)."""
        return sum(g.used * self.group_bytes_per_block(g) for g in self.groups)

    def bytes_per_token(self) -> float:
        """KV bytes one token takes over all layers while every layer still holds it (exact
        catalogue sizes); past the window only the global layers keep it: see
        `global_bytes_per_token`."""
        return self.config.bytes_per_block / self.config.block_size

    def global_bytes_per_token(self) -> float:
        """KV bytes one token takes in the layers that keep every token (no sliding window)."""
        return sum(self.group_bytes_per_block(g) for g in self.groups
                   if g.window is None) / self.config.block_size

    @property
    def layer_formats(self) -> tuple[KVFormat, ...]:
        return self.config.layer_formats
