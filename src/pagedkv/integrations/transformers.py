"""Hugging Face transformers (5.x) drop-in: a `Cache` whose layers hold K/V compressed in pages,
and an attention function that computes attention directly on those pages.

Usage:

    from pagedkv.integrations.transformers import PagedKVCache, register
    register()                                   # adds attn_implementation="pagedkv"
    model.set_attn_implementation("pagedkv")     # or from_pretrained(..., attn_implementation="pagedkv")
    cache = PagedKVCache(model, "turbo3")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)   # or cache=cache

How it works. transformers builds the mask first: the mask function registered for "pagedkv"
turns a 2D attention_mask into a small `PaddingMask` (no dense mask: causality and windows are
applied inside the ops). Each layer then calls `cache.update(k, v, layer_idx)` with the new
tokens' K/V (float [B, H, T, D]); `update` only takes them (tagged with the layer), and the
registered attention function, which receives the mask, stores the chunk's valid tokens
(`pagedkv.ops.store`; nothing already stored is touched) and runs `pagedkv.ops.prefill_attention`
(varlen: each row's valid queries) or `decode_attention` (T == 1), which read the codes through
the block tables. Every query, including those of a prompt, attends to compressed K/V, exactly as
in decoding. Without a PagedKVCache (plain forward, or transformers' own cache), the function
computes exact fp32 attention on the K/V it is given (pads masked), so a model switched to
"pagedkv" still runs everywhere.

Padded batches (left padding for `generate`, right padding for a plain forward): pad columns
(attention_mask 0) are never stored, so row r holds only its valid tokens, packed, and its
queries attend to its own tokens (bottom-right causal over what it stored; pad queries output
zeros, which transformers discards). `get_seq_length()` stays the column count transformers
expects (pads included); `row_lengths(columns)` gives each row's stored count. Positions come
from transformers (from the mask in `generate`; pass `position_ids` for a left-padded plain
forward, as with any attention). A batch shares one set of first-chunk statistics, fitted from
the valid tokens of all its rows. Sliding windows count stored tokens, which equals
transformers' column windows whenever pads only lead or trail a row (left / right padding).

Storage: layers are split into block groups: the global (full-attention) layers, and one group
per distinct sliding window W (Gemma2/3: 5 of 6 layers; Mistral v0.1: all). Each group has its
own block ids, one block table per batch row, and its layers' K and V pools (sized from the
catalogue, per-layer formats from `CacheConfig`: high-precision first/last layers); a block id
addresses the same slots of every layer of its group. Before a chunk is stored at a row's
positions n.., a sliding group releases the row's blocks wholly before position n - W + 1: no
query at or after n can see them (a query at p sees p - W < j <= p). So a sliding layer holds
each row's last W tokens (rounded out to blocks) plus the chunk being stored, not the whole
context; released table entries read as block 0, which the ops never touch (they skip blocks
wholly outside the window; the reference gathers and masks them, and every block holds finite
codes). A crop can go back to the start of the last chunk (`crop_limit`); `reclaim_sliding=False`
keeps every token. Pools grow by doubling when blocks run out unless `max_tokens` caps them (then
CacheFull, raised before any block is taken). Rows share full blocks after a beam reorder /
repeat (reference counts, per group); a shared block is copied before it is written.

Key centring (on by default for non-bf16 K): on its first stored chunk a layer fixes
`k_centre` from that chunk's valid tokens, values and queries per KV head (float32 [H, D], see
`calibration.calibrate`: the centre that minimises the chunk's expected attention-output error
under the K codec's error model); stored keys are k - k_centre and attention adds q . k_centre
back, which softmax makes exact. It removes the large shared component of keys (the RoPE-rotated bias most
models have) before quantization. Value centring (on by default for non-bf16 V, off in layers
with sinks) stores v - v_centre and adds v_centre to the output (the weights sum to one). The
whole transform (key centre and multipliers, value centre, fp8 scales) is part of the layer the
ops receive (`PagedLayer.k_mult` / `v_centre` / `k_centre`): the ops store and attend with it,
nothing is transformed around them, and a prefix store's record layout covers it.

Limitations: `torch.compile` is not supported; a prepared 4D attention mask is refused (pass
the 2D padding mask); the mask must cover every column seen so far ([B, past + new], as
`generate` passes it; a mask that disagrees with what the cache stored raises InvalidInput);
custom mask functions (bidirectional image-token masks, packed sequences) are not applied.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..cache.config import CacheConfig
from ..errors import ConfigError, InvalidInput
from ..formats import KVFormat
from ..approx import Approximation
from ..options import CacheOptions, default_key_centring
from ..spec import spec_and_arguments
from .hf_attention import _dense_attention, _pagedkv_mask, enable, paged_attention_forward, register
from .hf_common import (_TAG, ATTN_IMPLEMENTATION, GroupView, _concrete_class, _layer_layout,
                        _model_device, _model_identity, _transformers)
from .hf_layer import PagedCacheLayer
from .hf_rows import RowStorage

__all__ = ["PagedKVCache", "PagedCacheLayer", "GroupView", "register", "enable",
           "paged_attention_forward", "ATTN_IMPLEMENTATION"]
_REEXPORTED = (_TAG, _dense_attention, _pagedkv_mask, _model_device, _transformers)


class PagedKVCache(RowStorage):  # the transformers base class is mixed in lazily, see __new__
    """A transformers `Cache` storing K/V compressed in pages (see the module docstring).

    model_or_config: the model (its `.config` is used) or a HF config.
    kv_format: a spec (`pagedkv.spec`), or one format per layer. A spec means what it means on
    the command line and in vLLM: "turbo3" is turbo3 in every layer (5040 B/token on SmolLM2);
    "turbo3+hp" adds the automatic first/last high-precision layers (3+3 q8_0: 6480 B/token),
    "turbo3+hp2" two at each end; "turbo3+r64s16q8_0" adds a recent window (as
    recent_window=RecentWindow(64, "q8_0", sinks=16)); "plan.json" is a `pagedkv tune` plan.
    high_precision_layers, hp_format: the same policy as an argument (N, or "auto": N from the
    K codec, see `pagedkv.cache.config`); None (default) = what the name says.
    key_centring: None = on when some layer's K codec is not bf16.
    value_centring: store v - v_centre (the first chunk's values weighted by their squared
    attention, `calibration.attention_value_centre`) and add v_centre to the attention output:
    exact because softmax weights sum to one. None (default) = on for non-bf16 V except in
    layers that attend with sinks (their weight takes no value: not exact); True refuses sinks.
    key_scaling: per-channel key multipliers fitted to the first chunk's keys and queries (see
    `calibration.channel_multipliers`). Off by default: exact, but on SmolLM2 it did not lower KL (turbo3
    0.106 vs 0.107, turbo4 0.029 vs 0.026, q4_0 0.062 vs 0.055 on the first eval window).
    options: a `pagedkv.options.CacheOptions`, or its fields as keywords (block_size, hp_format,
    key_centring, value_centring, key_scaling, reclaim_sliding, recent_window, approx, backend,
    checks; the keywords replace the options' fields), as described here.
    block_size: tokens per block. max_tokens: None grows the pools on demand; an int caps every
    block group at that many tokens summed over rows (CacheFull beyond, raised before any change):
    the global layers' pools are allocated at that size; sliding-window layers' pools start small
    and grow up to it as needed (a row holds its last W tokens plus the chunk being stored there,
    so an all-sliding model decodes any length within max_tokens >= rows x (W + chunk + 2 blocks)).
    device: where the pools live (default: the model's device, else cpu).
    reclaim_sliding: sliding-window layers keep their own blocks (one group per distinct window)
    and release those no current or future query can see, so they hold about W + one chunk
    tokens per row instead of the whole context (see `crop_limit` for what that costs `crop`);
    False keeps every token in every layer (any crop works).
    backend: ops backend name (None = automatic). checks: the ops' value checks (NaN/Inf in K/V,
    slot ranges); False skips those scans (shape/dtype checks always run).
    approx: the approximate attention paths this cache's attention calls permit
    (`pagedkv.approx.Approximation` or its text form, e.g. "int8_scores"; None = exact).

    Padded batches: `get_seq_length()` counts columns (pads included, what transformers'
    generate expects); row r stores only its valid tokens, `row_lengths(columns)[r]` of them.
    """

    # bool [rows, columns] on cpu: which columns each row stored; None while every column was valid
    _valid: Optional[torch.Tensor] = None
    _lens_memo: Optional[tuple] = None  # (columns, row_lengths(columns))
    _valid_version = 0  # bumps whenever _valid changes
    _seq_lens_memo: Optional[tuple] = None
    tiers = None  # DropInTiers when built with offload= (PagedLatentCache: none)
    approx = Approximation()  # exact unless the constructor's approx= says otherwise

    def __init__(self, model_or_config, kv_format: Union[str, KVFormat, Sequence] = "turbo3", *,
                 high_precision_layers: Union[None, int, str] = None, max_tokens: Optional[int] = None,
                 device=None, check_attn_implementation: bool = True, offload=None, swap_tier=None,
                 prefix_tier=None, options: Optional[CacheOptions] = None, **option_fields):
        config = getattr(model_or_config, "config", model_or_config)
        opts = CacheOptions.of(options, **option_fields)  # ConfigError before anything is built
        self.options = opts
        self.approx = opts.approx
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
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens <= 0):
            raise ConfigError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
        block_size = opts.block_size
        initial_blocks = -(-max_tokens // block_size) if max_tokens else 16
        self.config = CacheConfig(
            num_layers=len(types), num_kv_heads=kv_heads[0], head_dim=head_dims[0],
            layer_dims=list(zip(kv_heads, head_dims)), kv_format=spec, hp_format=opts.hp_format,
            block_size=block_size, num_blocks=initial_blocks, sliding_window=windows,
            device=device or _model_device(model_or_config),
            model_id=_model_identity(model_or_config) if offload is not None else "",
            reclaim_sliding=opts.reclaim_sliding,
        )
        self.key_centring = default_key_centring(self.config.layer_formats, opts.key_centring)
        self.key_scaling = opts.key_scaling
        self.value_centring_auto = opts.value_centring is None
        self.value_centring = opts.value_centring is not False  # the sinks default: hf_attention
        self.backend = opts.backend
        self.checks = opts.checks
        self._make_groups(block_size, max_tokens)
        self.tiers = None
        if offload is not None:
            from .hf_tiers import DropInTiers

            self.tiers = DropInTiers(self, offload, swap_tier, prefix_tier)
        layers = [PagedCacheLayer(self, spec) for spec in self.config.layers]
        _, cache_utils = _transformers()
        cache_utils.Cache.__init__(self, layers=layers)
        _watch_input_ids(model_or_config)

    def __new__(cls, *args, **kwargs):
        # Subclass transformers' Cache lazily so importing pagedkv never imports transformers.
        _, cache_utils = _transformers()
        concrete = _concrete_class(cls, cache_utils.Cache)
        return object.__new__(concrete)

    # ---- per-row lengths (padded batches) -----------------------------------------------------
    def row_lengths(self, columns: int) -> list[int]:
        """Tokens each row has stored once the first `columns` columns of the batch are processed:
        pad columns (attention_mask 0) are never stored, so a row holds only its valid tokens."""
        if self._valid is None:
            return [columns] * self.batch_rows
        memo = self._lens_memo
        if memo is None or memo[0] != columns:
            memo = (columns, self._valid[:, :columns].sum(dim=1).tolist())
            self._lens_memo = memo
        return memo[1]

    def seq_lens_tensor(self, columns: int, device) -> torch.Tensor:
        """`row_lengths(columns)` as int32 [rows] on `device`, built once per step for all layers."""
        key = (columns, self.batch_rows, self._valid_version, str(device))
        if self._seq_lens_memo is None or self._seq_lens_memo[0] != key:
            t = torch.tensor(self.row_lengths(columns), dtype=torch.int32, device=device)
            self._seq_lens_memo = (key, t)
        return self._seq_lens_memo[1]

    def _record(self, start: int, valid: Optional[torch.Tensor], rows: int, count: int) -> None:
        """Note which of the columns start..start+count each row stored (valid: bool [rows, count],
        None = all). The first layer to store a chunk records it; the others find it there."""
        if self._valid is None:
            if valid is None:
                return
            self._valid = torch.ones(rows, start, dtype=torch.bool)
        width = self._valid.shape[1]
        if start + count <= width:
            return
        assert start <= width, (start, width)
        new = (torch.ones(rows, count, dtype=torch.bool) if valid is None
               else valid.detach().to("cpu", torch.bool))
        self._valid = torch.cat([self._valid[:, :start], new], dim=1)
        self._lens_memo = None
        self._valid_version += 1

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
        valid tokens among the kept columns. With sliding layers that released blocks, keeping
        fewer than `crop_limit()` columns (but more than 0) raises InvalidInput before any change."""
        self._flush()
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, length)
        keep = max(keep, 0)
        self._check_crop(keep)
        for layer in self.layers:
            layer.length = min(layer.length, keep)
        if self._valid is not None:
            self._valid = self._valid[:, :keep]
            self._lens_memo = None
            self._valid_version += 1
        self._truncate(self.row_lengths(max((layer.length for layer in self.layers), default=0)))

    def crop_limit(self) -> int:
        """The fewest columns `crop` can keep (0 without sliding layers): sliding-window layers
        release the blocks no query at or after the start of the last stored chunk can see, so a
        crop may go back to that start (always enough for assisted / speculative decoding, which
        crops only tokens of the last forward), or to 0 columns (every token dropped)."""
        limit = 0
        for g in self.groups:
            for r, dead in enumerate(g.dead):
                if dead:  # keep n tokens with n - W + 1 >= dead * block_size
                    n = dead * g.block_size + g.window - 1
                    # the columns at which row r has stored n tokens
                    cols = n if self._valid is None else \
                        int(torch.searchsorted(self._valid[r].long().cumsum(0), n)) + 1
                    limit = max(limit, cols)
        return limit

    def _check_crop(self, keep: int) -> None:
        lengths = self.row_lengths(keep)
        for g in self.groups:
            for r, dead in enumerate(g.dead):
                if dead and lengths[r] and g.first_needed(lengths[r]) < dead * g.block_size:
                    raise InvalidInput(
                        f"cannot crop to {keep} columns: row {r} would keep {lengths[r]} tokens and "
                        f"its sliding-window layers (window {g.window}) need positions from "
                        f"{g.first_needed(lengths[r])}, but released those before "
                        f"{dead * g.block_size}; the smallest crop kept is {self.crop_limit()} "
                        "columns (or 0)"
                    )

    def reset(self) -> None:
        """Drop every row, every stored prefix and every layer's statistics."""
        self.core.clear()
        self._rows = []
        self._uncommitted = False
        if self.tiers is not None:
            self.tiers.drop_dead()
        self._valid = None
        self._lens_memo = None
        self._valid_version += 1
        self._changed()
        for layer in self.layers:
            layer.reset()

    @property
    def is_compileable(self) -> bool:
        return False

    # ---- memory accounting ------------------------------------------------------------------
    def pool_bytes(self) -> int:
        """Bytes of every layer's K and V pools as allocated now (plus fp8 scales / centres)."""
        return sum(layer.pool_bytes() for layer in self.layers)

    def group_bytes_per_block(self, group: "GroupView") -> int:
        """Bytes one block id of `group` takes, summed over its layers' K and V blocks (and the
        recent-window tails it holds: the tail codec on both sides)."""
        specs = self.config.layers
        out = sum(specs[i].k_block_bytes + specs[i].v_block_bytes for i in group.layers)
        if group.tails:
            c, bs = self.recent_window.codec, self.config.block_size
            out += sum(2 * c.block_bytes(bs, specs[i].num_kv_heads, specs[i].head_dim)
                       for i in group.tails)
        return out

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


def _note_input_ids(module, args, kwargs):
    """Forward pre-hook: hand the forward's input_ids to the PagedKVCache it runs with, so the
    chunk's blocks are keyed by their token ids (prefix hits across `generate` calls)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, PagedKVCache):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache._next_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _watch_input_ids(model) -> None:
    if hasattr(model, "register_forward_pre_hook") and not getattr(model, "_pagedkv_ids_hook", False):
        model.register_forward_pre_hook(_note_input_ids, with_kwargs=True)
        model._pagedkv_ids_hook = True

