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
with sinks) stores v - v_centre and adds v_centre to the output (the weights sum to one).

Limitations: `torch.compile` is not supported; a prepared 4D attention mask is refused (pass
the 2D padding mask); the mask must cover every column seen so far ([B, past + new], as
`generate` passes it; a mask that disagrees with what the cache stored raises InvalidInput);
custom mask functions (bidirectional image-token masks, packed sequences) are not applied.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import replace
from typing import Optional, Sequence, Union

import torch

from ..cache.config import CacheConfig
from ..errors import ConfigError, InvalidInput
from ..formats import KVFormat
from ..heap import release_free_heap
from ..ops import AttentionParams, PagedLayer, decode_attention, prefill_attention, store
from ..alloc.manager import BlockManager, GroupSpec, GroupStep
from ..cache.tables import block_table_tensor, int_tensor
from .calibration import CalibrationOptions, calibrate
from .padding import PaddingMask, chunk_validity as _chunk_validity, valid_tokens as _valid_tokens

ATTN_IMPLEMENTATION = "pagedkv"
_TAG = "_pagedkv_layer"


def _transformers():
    try:
        import transformers  # noqa: F401
        from transformers import cache_utils
    except ImportError:  # pragma: no cover
        raise ConfigError("the transformers integration needs transformers>=5: pip install 'pagedkv[model]'") from None
    return transformers, cache_utils


# ---------------------------------------------------------------------------------------------
# the cache


def _layer_layout(config) -> tuple[list[str], list[Optional[int]], list[int], list[int]]:
    """Per model layer: type, sliding window, num_kv_heads, head_dim (from a HF config)."""
    _, cache_utils = _transformers()
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "kv_lora_rank", None):  # MLA caches one latent per token, not K/V per head
        raise ConfigError(
            f"{type(text).__name__} uses latent attention (MLA); use "
            "pagedkv.integrations.deepseek.PagedLatentCache (and deepseek.enable(model))"
        )
    types, kwargs = cache_utils.get_layer_types_and_kwargs(text)
    n_heads = text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or n_heads
    hd = getattr(text, "head_dim", None) or text.hidden_size // n_heads
    windows = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        if t == "full_attention":
            windows.append(None)
        elif t in ("sliding_attention",):
            windows.append(int(kw["sliding_window"]))
        else:
            raise ConfigError(
                f"layer {i} of this model is {t!r}; the pagedkv cache supports full_attention and "
                "sliding_attention layers (Llama, Qwen2/3, Mistral, Gemma2/3 families)"
            )
    L = len(types)
    return list(types), windows, [kv] * L, [hd] * L


class PagedKVCache:  # the transformers base class is mixed in lazily, see __new__
    """A transformers `Cache` storing K/V compressed in pages (see the module docstring).

    model_or_config: the model (its `.config` is used) or a HF config.
    kv_format: a format name / KVFormat, or one per layer. A name means what it means on the
    command line: "turbo3" is turbo3 in every layer (5040 B/token on SmolLM2);
    "turbo3+hp" adds the automatic first/last high-precision layers (3+3 q8_0: 6480 B/token),
    "turbo3+hp2" two at each end.
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

    Padded batches: `get_seq_length()` counts columns (pads included, what transformers'
    generate expects); row r stores only its valid tokens, `row_lengths(columns)[r]` of them.
    """

    # bool [rows, columns] on cpu: which columns each row stored; None while every column was valid
    _valid: Optional[torch.Tensor] = None
    _lens_memo: Optional[tuple] = None  # (columns, row_lengths(columns))
    _valid_version = 0  # bumps whenever _valid changes
    _seq_lens_memo: Optional[tuple] = None
    tiers = None  # DropInTiers when built with offload= (PagedLatentCache: none)

    def __init__(self, model_or_config, kv_format: Union[str, KVFormat, Sequence] = "turbo3", *,
                 high_precision_layers: Union[None, int, str] = None, hp_format: Union[str, KVFormat] = "q8_0",
                 key_centring: Optional[bool] = None, value_centring: Optional[bool] = None,
                 key_scaling: bool = False,
                 block_size: int = 16,
                 max_tokens: Optional[int] = None, device=None, backend: Optional[str] = None,
                 checks: bool = True, check_attn_implementation: bool = True,
                 reclaim_sliding: bool = True, offload=None, swap_tier=None, prefix_tier=None):
        config = getattr(model_or_config, "config", model_or_config)
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
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        initial_blocks = -(-max_tokens // block_size) if max_tokens else 16
        self.config = CacheConfig(
            num_layers=len(types), num_kv_heads=kv_heads[0], head_dim=head_dims[0],
            layer_dims=list(zip(kv_heads, head_dims)), kv_format=kv_format,
            high_precision_layers=high_precision_layers, hp_format=hp_format,
            block_size=block_size, num_blocks=initial_blocks, sliding_window=windows,
            device=device or _model_device(model_or_config),
            model_id=_model_identity(model_or_config) if offload is not None else "",
        )
        if key_centring is None:
            key_centring = any(s.format.k.name != "bf16" for s in self.config.layers)
        self.key_centring = bool(key_centring)
        self.key_scaling = bool(key_scaling)
        self.value_centring_auto = value_centring is None
        self.value_centring = True if value_centring is None else bool(value_centring)
        self.backend = backend
        self.checks = bool(checks)
        self._make_groups(block_size, max_tokens, reclaim_sliding)
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

    # ---- storage shared by the layers ---------------------------------------------------------
    def _make_groups(self, block_size: int, max_tokens: Optional[int], reclaim_sliding: bool = True) -> None:
        """One block group per distinct sliding window (None = the global layers), each with its
        own block ids, tables and pools, all managed by one `pagedkv.alloc.BlockManager` (rows
        are its sequences). `self.blocks` is the global group (the first sliding group when
        every layer slides). With max_tokens every group may hold at most
        ceil(max_tokens / block_size) blocks: the global group is allocated at that size, a
        sliding group starts small and grows on demand (it holds at most what the global group
        holds, usually far less: each row's last W tokens plus the chunk being stored).
        reclaim_sliding=False: one group for every layer, nothing released (any crop works)."""
        cap = -(-max_tokens // block_size) if max_tokens else None
        windows = [s.sliding_window if reclaim_sliding else None for s in self.config.layers]
        keys = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        specs = []
        for w in keys:
            initial = cap if (cap is not None and w is None) else min(cap or 16, 16)
            specs.append(GroupSpec(w, initial, cap if cap is not None else _UNBOUNDED))
        self.core = BlockManager(specs, block_size, self.config.fingerprint)
        self.groups = [GroupView(self, i, w, [j for j, x in enumerate(windows) if x == w])
                       for i, w in enumerate(keys)]
        self.blocks = self.groups[0]
        self._group_of = {i: g for g in self.groups for i in g.layers}
        self._rows: list[int] = []
        self._sids = itertools.count()
        self._plan: Optional[tuple] = None  # (key, StepPlan, {(group, device): slots})
        self._uncommitted = False
        self._tables: dict = {}  # (group, device) -> int32 tables of the current step
        self._next_ids: Optional[torch.Tensor] = None  # input_ids of the running forward
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0

    @property
    def batch_rows(self) -> int:
        return len(self._rows)

    def _ensure_rows(self, batch: int) -> None:
        if not self._rows:
            for _ in range(batch):
                sid = next(self._sids)
                self.core.add(sid, [], rest=True)
                self._rows.append(sid)
            self._changed()
        elif batch != len(self._rows):
            raise InvalidInput(
                f"batch size {batch} differs from the cache's {len(self._rows)} rows; "
                "use a fresh PagedKVCache per batch (or batch_select_indices)"
            )

    def _changed(self) -> None:
        """Rows or tables changed outside a step: the next chunk plans afresh."""
        self._plan = None
        self._tables = {}

    def _commit(self) -> None:
        """Every layer stored the last step: its tokens are committed (full blocks with known
        token ids become prefix hits for later sequences)."""
        if self._uncommitted:
            self.core.commit(self._rows)
            self._uncommitted = False
            if self.tiers is not None:
                self.tiers.after_commit()

    def _rows_changed(self) -> None:
        self._changed()
        if self.tiers is not None:
            self.tiers.drop_dead()

    def _apply_sizes(self) -> None:
        """Resize pools to their groups' block counts (after growth outside a step)."""
        for view in self.groups:
            step = GroupStep((), view.num_blocks, (), ())
            for i in view.layers:
                self.layers[i]._apply(step)

    def attention_inputs(self, layer, device):
        """(PagedLayer, int32 block tables [rows, width]) the layer attends through (swapped
        blocks read back when the tiers swapped some)."""
        if self.tiers is not None:
            return self.tiers.attention(layer, device)
        return layer.paged, self.block_table_tensor(device, layer.group)

    def offload_stats(self) -> dict:
        """Swapped blocks now, and the swap and prefix tiers' counters."""
        out = {"swapped_blocks": sum(len(self.core.main.swapped(s)) for s in self._rows)}
        t = self.tiers
        if t is not None and t.swap is not None:
            out["swap"] = dataclasses.asdict(t.swap.swap.stats)
        if t is not None and t.prefix is not None:
            out["prefix"] = dataclasses.asdict(t.prefix.store.stats)
        return out

    def close(self) -> None:
        """Delete this cache's swap records and close its tiers."""
        if self.tiers is not None:
            self.tiers.close()

    def _slots(self, start: int, count: int, device) -> torch.Tensor:
        """Slots for positions start..start+count of every row (row-major) in the global group.
        int64 [rows * count]."""
        return self._slots_rows([start] * self.batch_rows, [count] * self.batch_rows, device)

    def _slots_rows(self, starts: Sequence[int], counts: Sequence[int], device,
                    group: Optional["GroupView"] = None, valid: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
        """Slots (in `group`, default the global one) for the next counts[r] tokens of each row
        r (stored after its starts[r] tokens), row-major. The first layer of a forward to store
        asks the block manager for the step of every group at once (window reclaim, growth,
        compaction, copy-on-write: all or nothing, CacheFull before any change) and applies its
        plan to every layer's pools; the other layers find it here. int64 [sum(counts)]."""
        g = self.blocks if group is None else group
        key = (tuple(starts), tuple(counts))
        if self._plan is None or self._plan[0] != key:
            self._commit()
            plan = self.core.step(self._rows, self._step_tokens(counts, valid))
            for view, gs in zip(self.groups, plan.groups):
                for i in view.layers:
                    self.layers[i]._apply(gs)
            self._plan = (key, plan, {})
            self._tables = {}
            self._uncommitted = True
        memo = self._plan[2]
        slots = memo.get((g.index, str(device)))
        if slots is None:
            slots = int_tensor(self._plan[1].groups[g.index].slots, torch.int64, device)
            memo[(g.index, str(device))] = slots
        return slots

    def _step_tokens(self, counts: Sequence[int], valid: Optional[torch.Tensor]) -> list:
        """Per row the token ids of the chunk (from the forward's input_ids, valid columns
        only) or, when they are unknown, the count (such blocks are never prefix keys)."""
        ids, self._next_ids = self._next_ids, None
        if ids is None or ids.dim() != 2 or ids.shape[0] != len(counts):
            return list(counts)
        rows = ids.detach().cpu().tolist() if valid is None else \
            [r.tolist() for r in ids.detach().cpu()[valid.cpu()].split(list(counts))]
        if [len(r) for r in rows] != list(counts):
            return list(counts)
        return rows

    def begin(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, *,
              reuse: bool = True) -> int:
        """Start a new batch reusing this cache's stored prefixes: call before
        `model.generate(input_ids, past_key_values=cache)` (or `cache=cache`). The previous rows
        are dropped (their committed full blocks stay cached); each new row takes the longest
        run of whole blocks its prompt shares with what the cache stored before (the same run
        for every row, always leaving one token to compute, none for padded rows or when some
        layers slide). Returns the hit tokens: `generate` then computes only the rest.
        input_ids int [B, T]; attention_mask [B, T] or None; reuse=False starts the batch
        without prefix hits (the layers keep their statistics)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InvalidInput(f"begin needs input_ids int [batch, tokens], got "
                               f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        self._flush()
        self._commit()
        rows = input_ids.detach().cpu().tolist()
        padded = attention_mask is not None and not bool(attention_mask.bool().all())
        for sid in self._rows:
            self.core.free(sid)
        self._rows = []
        self._rows_changed()
        if self.tiers is not None and reuse and not padded:
            self.tiers.before_begin(rows)
        hit = 0 if padded or not reuse or not self.layers[0].is_initialized else \
            min(self.core.main.match(r) for r in rows)
        for r in rows:
            sid = next(self._sids)
            self.core.add(sid, r, rest=False, max_hit_blocks=hit)
            self._rows.append(sid)
        for layer in self.layers:
            layer.length = hit * self.config.block_size
            layer.pending = None
        self._valid, self._lens_memo = None, None
        self._valid_version += 1
        self._changed()
        self.prefix_hit_tokens += hit * self.config.block_size * len(rows)
        self.prefix_query_tokens += sum(len(r) for r in rows)
        return hit * self.config.block_size

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

    def block_table_tensor(self, device, group: Optional["GroupView"] = None) -> torch.Tensor:
        """int32 [rows, max_blocks] of `group` (default: the global one): entries past a row's
        table and released entries read as block 0, which the ops never read."""
        g = self.blocks if group is None else group
        key = (g.index, str(device))
        t = self._tables.get(key)
        if t is None:
            seqs = self.core.groups[g.index]
            t = block_table_tensor([seqs.table(s) for s in self._rows], torch.device("cpu"))
            t = t.clamp(min=0).to(device)
            self._tables[key] = t
        return t

    def _flush(self) -> None:
        for layer in self.layers:
            layer.flush()

    def _rearrange_rows(self, sources: Sequence[int]) -> None:
        """New row i = old row sources[i] (fork, then the old rows are freed): blocks are
        shared (one reference count per holder), a shared partial block is copied when it is
        next written."""
        self._flush()
        self._commit()
        if self._valid is not None:
            self._valid = self._valid[torch.tensor(list(sources), dtype=torch.long)]
            self._lens_memo = None
            self._valid_version += 1
        new = [self.core.fork(self._rows[s], next(self._sids)) for s in sources]
        for sid in self._rows:
            self.core.free(sid)
        self._rows = new
        self._rows_changed()

    def _truncate(self, length: Union[int, Sequence[int]]) -> None:
        """Drop each row's tokens past `length` (one int for every row, or one per row)."""
        lengths = [length] * self.batch_rows if isinstance(length, int) else list(length)
        for sid, n in zip(self._rows, lengths):
            cur = self.core.length(sid)
            if cur > n:
                rids = self.core.check_pop(sid, cur - n)
                back = self.core.pop(sid, cur - n)
                self._apply_sizes()
                if back[0] is not None:  # the new last block was swapped out: read it back
                    self.tiers.restore(rids[0], back[0])
        self._rows_changed()

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
        """Bytes one block id of `group` takes, summed over its layers' K and V blocks."""
        specs = self.config.layers
        return sum(specs[i].k_block_bytes + specs[i].v_block_bytes for i in group.layers)

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


def _model_identity(model_or_config) -> str:
    """What names the model in shared prefix keys: a hash of its weights when they are at hand
    (`pagedkv.offload.weights_identity`), else its config's name and dims."""
    if isinstance(model_or_config, torch.nn.Module):
        from ..offload.identity import weights_identity

        return weights_identity(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    return "|".join(str(getattr(config, k, "")) for k in ("_name_or_path", "model_type",
                                                            "hidden_size", "num_hidden_layers"))


def _watch_input_ids(model) -> None:
    if hasattr(model, "register_forward_pre_hook") and not getattr(model, "_pagedkv_ids_hook", False):
        model.register_forward_pre_hook(_note_input_ids, with_kwargs=True)
        model._pagedkv_ids_hook = True


_UNBOUNDED = 1 << 40  # "grow on demand": a block-id limit no pool reaches


class GroupView:
    """Read-only view of one block group of a PagedKVCache (tests, accounting): its window,
    layers, and per row its table (-1 = released by the window) and released count."""

    def __init__(self, cache: "PagedKVCache", index: int, window: Optional[int], layers: list[int]):
        self.cache, self.index, self.window, self.layers = cache, index, window, layers
        self.block_size = cache.config.block_size

    @property
    def seqs(self):
        return self.cache.core.groups[self.index]

    @property
    def name(self) -> str:
        return "global" if self.window is None else f"sliding-window (W={self.window})"

    @property
    def tables(self) -> list[list[int]]:
        return [list(self.seqs.table(s)) for s in self.cache._rows]

    @property
    def dead(self) -> list[int]:
        return [self.seqs.dead(s) for s in self.cache._rows]

    @property
    def used(self) -> int:
        return self.seqs.pool.num_used

    @property
    def num_blocks(self) -> int:
        return self.seqs.pool.num_blocks

    def first_needed(self, length: int) -> int:
        return self.seqs.first_needed(length)


_CONCRETE: dict = {}


def _concrete_class(cls, base):
    if issubclass(cls, base):
        return cls
    if cls not in _CONCRETE:
        _CONCRETE[cls] = type(cls.__name__, (cls, base), {"__doc__": cls.__doc__, "__module__": cls.__module__})
    return _CONCRETE[cls]


def _model_device(model_or_config):
    try:
        return next(model_or_config.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


class PagedCacheLayer:
    """One model layer's paged K/V (transformers CacheLayerMixin contract).

    `length`: columns processed (pads included, as transformers counts); row r holds
    `cache.row_lengths(length)[r]` valid tokens. `pending`: (k, v, start column) of the chunk
    `update` received, stored by the attention function once it knows the chunk's padding.
    `paged`: the ops' PagedLayer (pools, codecs, fp8 scales, key centre), rebuilt when the pools
    grow or the centre is fixed.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __new__(cls, *args, **kwargs):
        _, cache_utils = _transformers()
        return object.__new__(_concrete_class(cls, cache_utils.CacheLayerMixin))

    def __init__(self, cache: PagedKVCache, spec):
        self.keys = None
        self.values = None
        self.is_initialized = False
        self.cache = cache
        self.spec = spec
        self.sliding_window = spec.sliding_window
        self.is_sliding = spec.sliding_window is not None
        self.length = 0
        self.paged: Optional[PagedLayer] = None
        self.k_mult: Optional[torch.Tensor] = None  # float32 [H, D]: stored keys are k * k_mult
        self.pending = None  # (k, v, start column) of the chunk waiting for the attention function
        self.scale_keys = cache.key_scaling and spec.format.k.name != "bf16"
        self.centre_values = cache.value_centring and spec.format.v.name != "bf16"
        self.v_centre: Optional[torch.Tensor] = None  # float32 [H, D]
        self.device = cache.config.device
        self.group: GroupView = cache._group_of[spec.index]

    def __repr__(self):
        return f"PagedCacheLayer({self.spec.index}, {self.spec.format.name}, len={self.length})"

    # pools ---------------------------------------------------------------------------------
    def _make(self, num_blocks: int) -> PagedLayer:
        s, dev = self.spec, self.device
        return PagedLayer(
            k_pool=torch.zeros(num_blocks, s.k_block_bytes, dtype=torch.uint8, device=dev),
            v_pool=torch.zeros(num_blocks, s.v_block_bytes, dtype=torch.uint8, device=dev),
            k_codec=s.format.k, v_codec=s.format.v, block_size=self.cache.config.block_size,
            num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
            k_scale=torch.ones(1, dtype=torch.float32, device=dev),
            v_scale=torch.ones(1, dtype=torch.float32, device=dev),
        )

    def _pool_names(self) -> tuple[str, ...]:
        return ("k_pool", "v_pool")

    def transform(self) -> dict:
        """The layer's stored-bytes transform (float32 tensors or None), see calibration."""
        p = self.paged
        return {"k_centre": p.k_centre, "k_mult": self.k_mult, "v_centre": self.v_centre,
                "k_scale": p.k_scale, "v_scale": p.v_scale}

    def transform_shapes(self) -> dict:
        hd = (self.spec.num_kv_heads, self.spec.head_dim)
        return {"k_centre": hd, "k_mult": hd, "v_centre": hd, "k_scale": (1,), "v_scale": (1,)}

    def adopt(self, t: dict) -> None:
        """Initialize from a stored transform (a shared prefix store's) instead of fitting one."""
        dev = self.device
        p = self._make(self.group.num_blocks)
        on = {k: (None if v is None else v.to(dev, torch.float32)) for k, v in t.items()}
        self.k_mult, self.v_centre = on["k_mult"], on["v_centre"]
        self.paged = replace(p, k_centre=on["k_centre"],
                             k_scale=on["k_scale"] if on["k_scale"] is not None else p.k_scale,
                             v_scale=on["v_scale"] if on["v_scale"] is not None else p.v_scale)
        self.is_initialized = True

    def _apply(self, step) -> None:
        """Apply one group step of the block manager's plan to this layer's pools: moves then
        a cut (new tensors, so the memory is returned), or growth; then copy-on-write."""
        if self.paged is None:
            return
        p = self.paged
        changes = {}
        for name in self._pool_names():
            pool = getattr(p, name)
            if step.moves:
                src = torch.tensor([m[0] for m in step.moves], device=pool.device)
                pool[torch.tensor([m[1] for m in step.moves], device=pool.device)] = pool[src]
            if pool.shape[0] > step.num_blocks:
                pool = pool[:step.num_blocks].clone()
            elif pool.shape[0] < step.num_blocks:
                grown = torch.zeros(step.num_blocks, pool.shape[1], dtype=pool.dtype, device=pool.device)
                grown[:pool.shape[0]] = pool
                pool = grown
            if step.copies:
                src = torch.tensor([c[0] for c in step.copies], device=pool.device)
                pool[torch.tensor([c[1] for c in step.copies], device=pool.device)] = pool[src]
            changes[name] = pool
        self.paged = replace(p, **changes)

    def pool_bytes(self) -> int:
        if self.paged is None:
            return 0
        p = self.paged
        extra = 8 + (0 if p.k_centre is None else p.k_centre.numel() * 4)
        extra += 0 if self.k_mult is None else self.k_mult.numel() * 4
        extra += 0 if self.v_centre is None else self.v_centre.numel() * 4
        return p.k_pool.numel() + p.v_pool.numel() + extra

    # contract -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            query_states: Optional[torch.Tensor] = None) -> None:
        """Fix the pools, the key centre, the key channel multipliers and the fp8 tensor scales
        from the first chunk (keys/values float [B, H, T, D], queries [B, Hq, T, D] or None)."""
        s = self.spec
        if key_states.shape[1] != s.num_kv_heads or key_states.shape[-1] != s.head_dim:
            raise InvalidInput(
                f"layer {s.index}: keys {tuple(key_states.shape)} do not match the cache's "
                f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}"
            )
        p = self._make(self.group.num_blocks)
        options = CalibrationOptions(key_centring=self.cache.key_centring, key_scaling=self.scale_keys,
                                     value_centring=self.centre_values)
        cal = calibrate(key_states, value_states, query_states, p.k_codec.name, p.v_codec.name,
                        options, p.device)
        self.k_mult, self.v_centre = cal.k_mult, cal.v_centre
        changes = {name: getattr(cal, name) for name in ("k_centre", "k_scale", "v_scale")
                   if getattr(cal, name) is not None}
        self.paged = replace(p, **changes) if changes else p
        self.is_initialized = True
        release_free_heap()  # the statistics' one-time temporaries would stay as heap holes,
        # accumulating over the first chunk's layers (~1-1.5 MB on SmolLM2, the turbo3 run's peak)

    def _store_chunk(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int,
                     valid: Optional[torch.Tensor] = None,
                     query_states: Optional[torch.Tensor] = None) -> None:
        """Store the valid tokens of the chunk at columns start.. (keys/values float [B, H, T, D];
        valid bool [B, T] or None = all), packed per row after the row's stored tokens. The
        layer's first chunk with a valid token fixes its statistics from the valid tokens (and
        the valid queries [B, Hq, T, D], when given) first."""
        b, h, t, d = key_states.shape
        cache = self.cache
        starts = cache.row_lengths(start)
        counts = [t] * b if valid is None else valid.sum(dim=1).tolist()
        if sum(counts):
            if not self.is_initialized:
                q = None if query_states is None else _valid_tokens(query_states, valid, counts)
                self.lazy_initialization(_valid_tokens(key_states, valid, counts),
                                         _valid_tokens(value_states, valid, counts), q)
            k = key_states.transpose(1, 2)  # [B, T, H, D]
            v = value_states.transpose(1, 2)
            k = k.reshape(b * t, h, d) if valid is None else k[valid]
            v = v.reshape(b * t, h, d) if valid is None else v[valid]
            if self.k_mult is not None:
                k = k.float() * self.k_mult
            if self.v_centre is not None:
                v = v.float() - self.v_centre
            slots = cache._slots_rows(starts, counts, self.paged.device, self.group, valid)
            store(self.paged, k, v, slots, backend=cache.backend, checks=cache.checks)
        cache._record(start, valid, b, t)

    def flush(self, query_states: Optional[torch.Tensor] = None,
              valid: Optional[torch.Tensor] = None) -> None:
        """Store the chunk `update` left for the attention function (every token valid unless
        `valid` bool [B, T] says otherwise; queries [B, Hq, T, D] for the key statistics)."""
        if self.pending is None:
            return
        k, v, start = self.pending
        self.pending = None
        self._store_chunk(k, v, start, valid, query_states)

    def _abort(self, pending, was_initialized: bool) -> None:
        """Forget the chunk `pending` (k, v, start) that the attention function refused or failed
        to store, so the layer is as it was before `update` (statistics a failed first chunk
        fixed are dropped too)."""
        if pending is None:
            return
        self.pending = None
        self.length = pending[2]
        if not was_initialized:
            self.paged, self.k_mult, self.v_centre, self.is_initialized = None, None, None, False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Take the new tokens' K/V (float [B, H, T, D]); return them tagged with this layer for
        the attention function. Nothing is stored here: the attention function receives the
        chunk's padding mask, then stores the valid tokens compressed (`flush`) and attends
        (a chunk the attention function never saw is stored whole by the next `update`)."""
        s = self.spec
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise InvalidInput(
                f"layer {s.index}: expected keys and values [B, H, T, D] of one shape, got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.shape[1] != s.num_kv_heads or key_states.shape[-1] != s.head_dim:
            raise InvalidInput(
                f"layer {s.index}: keys {tuple(key_states.shape)} do not match the cache's "
                f"{s.num_kv_heads} KV heads x head_dim {s.head_dim}"
            )
        b, h, t, d = key_states.shape
        self.cache._ensure_rows(b)
        self.flush()  # attention never ran for the previous chunk: store it whole
        if t:
            self.pending = (key_states, value_states, self.length)
            self.length += t
        setattr(key_states, _TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
        self.paged = None
        self.k_mult = None
        self.v_centre = None
        self.pending = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:  # the cache crops all layers together
        self.cache.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        self.cache.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self.cache.batch_select_indices(indices)

    def offload(self):  # pools stay where they are
        pass

    def prefetch(self):
        pass


# ---------------------------------------------------------------------------------------------
# attention function


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask=None, scaling: Optional[float] = None,
                            dropout: float = 0.0, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function ("pagedkv").

    query float [B, Hq, Tq, D]; key/value float [B, H, Tk, D] as returned by the cache;
    attention_mask: a `PaddingMask` (from `_pagedkv_mask`) or None. With a PagedKVCache layer,
    the chunk's valid tokens are stored, then each row's valid queries attend to that row's
    compressed pages (varlen, bottom-right causal); pad queries get zeros. Otherwise it is exact
    fp32 attention over `key`/`value` (bottom-right causal, pads masked). Returns
    ([B, Tq, Hq, D], None).
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is None:
        softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    sinks = s_aux.float() if s_aux is not None else None
    layer: Optional[PagedCacheLayer] = getattr(key, _TAG, None)
    if layer is None:
        if attention_mask is not None and not isinstance(attention_mask, PaddingMask):
            raise InvalidInput(f"attn_implementation='pagedkv' takes a 2D attention_mask, got a "
                               f"prepared {type(attention_mask).__name__}")
        key_valid = None if attention_mask is None else attention_mask.key_validity(key.shape[2])
        return _dense_attention(query, key, value, scaling, sliding_window, softcap, sinks, key_valid), None
    b, hq, tq, d = query.shape
    pending = layer.pending if layer.pending is not None and layer.pending[0] is key else None
    was_initialized = layer.is_initialized
    window = sliding_window if sliding_window is not None else layer.sliding_window
    try:
        if layer.group.window is not None and (window is None or window > layer.group.window):
            raise InvalidInput(
                f"layer {layer.spec.index} attends with sliding_window={window} but its cache layer "
                f"keeps only the last {layer.group.window} tokens (the model config's window)")
        if layer.centre_values and sinks is not None and layer.cache.value_centring_auto \
                and not layer.is_initialized:
            layer.centre_values = False  # the default skips centring where sinks make it inexact
        if layer.centre_values and sinks is not None:
            raise ConfigError("value centring is not exact with attention sinks (their weight takes no "
                              "value); create the PagedKVCache with value_centring=False")
        valid = _chunk_validity(attention_mask, layer, b, tq)
        layer.flush(query, valid)  # store the chunk's valid tokens (the first fixes the statistics)
    except Exception:
        layer._abort(pending, was_initialized)
        raise
    if layer.k_mult is not None:  # q . k == (q / m) . (k * m): stored keys are k * m
        g = hq // layer.k_mult.shape[0]
        query = (query.float() / layer.k_mult.repeat_interleave(g, dim=0)[None, :, None, :]).to(query.dtype)
    params = AttentionParams(scale=float(scaling), sliding_window=window, soft_cap=softcap, sinks=sinks)
    cache = layer.cache
    dev = query.device
    seq_lens = cache.seq_lens_tensor(layer.length, dev)
    q = query.transpose(1, 2)  # [B, Tq, Hq, D]
    if valid is None:
        counts = None
        q_rows = q.reshape(b * tq, hq, d)
    else:
        counts = valid.sum(dim=1)
        q_rows = q[valid.to(dev)]  # [N, Hq, D]: the valid queries, row-major
    if q_rows.shape[0] == 0:
        out = q_rows.float()
    elif layer.paged is None:  # nothing stored yet (every token so far a pad)
        out = torch.zeros(q_rows.shape, dtype=torch.float32, device=dev)
    elif tq == 1 and valid is None:
        paged, tables = cache.attention_inputs(layer, dev)
        out = decode_attention(q_rows.contiguous(), paged, tables, seq_lens,
                               params, backend=cache.backend, checks=cache.checks)
    else:
        if counts is None:
            qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * tq
        else:
            qsl = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            qsl[1:] = torch.cumsum(counts.to(dev), 0)
        paged, tables = cache.attention_inputs(layer, dev)
        out = prefill_attention(q_rows.contiguous(), paged, tables, seq_lens,
                                qsl, params, backend=cache.backend, checks=cache.checks)
    if layer.v_centre is not None:  # sum_j p_j (v_j - c) + c, the weights summing to one
        g = hq // layer.v_centre.shape[0]
        out = out.float()  # the ops' own output: added to in place (no second output-sized buffer)
        out.add_(layer.v_centre.repeat_interleave(g, dim=0))
    out = out.to(query.dtype)
    if valid is None:
        return out.reshape(b, tq, hq, d), None
    full = torch.zeros(b, tq, hq, d, dtype=query.dtype, device=dev)  # pad queries: zeros
    full[valid.to(dev)] = out
    return full, None


def _dense_attention(query, key, value, scaling, window, softcap, sinks, key_valid=None):
    """Exact fp32 attention, bottom-right causal: query [B, Hq, Tq, D], key/value [B, H, Tk, D],
    key_valid bool [B, Tk] or None (pads are never attended; a query that sees no key gets
    zeros) -> [B, Tq, Hq, D]."""
    b, hq, tq, d = query.shape
    h, tk = key.shape[1], key.shape[2]
    g = hq // h
    q = query.float().reshape(b, h, g, tq, d)
    s = torch.einsum("bhgtd,bhnd->bhgtn", q, key.float()) * scaling
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(tk - tq, tk, device=query.device)[:, None]
    kpos = torch.arange(tk, device=query.device)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    visible = visible[None, None, None]  # [1, 1, 1, Tq, Tk]
    if key_valid is not None:
        visible = visible & key_valid.to(query.device)[:, None, None, None, :]
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sk = sinks.reshape(1, h, g, 1, 1).expand(b, h, g, tq, 1)
        s = torch.cat([s, sk], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    if key_valid is not None:  # rows seeing no key: softmax of all -inf is NaN
        p = torch.where(visible.any(dim=-1, keepdim=True), p, torch.zeros((), dtype=p.dtype, device=p.device))
    out = torch.einsum("bhgtn,bhnd->bhgtd", p, value.float())
    return out.reshape(b, hq, tq, d).transpose(1, 2).to(query.dtype)


def _pagedkv_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                  attention_mask=None, **kwargs) -> Optional[PaddingMask]:
    """Mask interface for "pagedkv": causal and sliding masks are applied inside the ops, so no
    mask tensor is built. A 2D attention_mask (bool [B, columns seen + new]) becomes a
    `PaddingMask`; its shape is checked here, before any layer runs."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise InvalidInput(
            f"attention_mask must be 2D [batch, columns], got shape {list(attention_mask.shape)}")
    width = int(kv_offset) + int(kv_length)
    rows, cols = attention_mask.shape
    if rows != batch_size or cols > width or cols < q_length:
        raise InvalidInput(
            f"attention_mask has shape {[rows, cols]}; expected [{batch_size}, {width}] (batch rows x "
            f"tokens already cached + the {q_length} new ones)"
        )
    return PaddingMask(attention_mask.to(torch.bool), int(q_length), int(kv_length), int(kv_offset))


_registered = False


def register() -> None:
    """Register "pagedkv" with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    transformers, _ = _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _pagedkv_mask)
    _registered = True


def enable(model) -> None:
    """Register the attention function and switch `model` to it."""
    register()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
