"""Hugging Face transformers (5.x) drop-in: a `Cache` whose layers hold K/V compressed in pages,
and an attention function that computes attention directly on those pages.

Usage:

    from pagedkv.integrations.transformers import PagedKVCache, register
    register()                                   # adds attn_implementation="pagedkv"
    model.set_attn_implementation("pagedkv")     # or from_pretrained(..., attn_implementation="pagedkv")
    cache = PagedKVCache(model, "turbo3")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)   # or cache=cache

How it works. transformers calls `cache.update(k, v, layer_idx)` with the new tokens' K/V
(float [B, H, T, D]) and then the registered attention function with what `update` returned.
`update` encodes the new rows into the layer's pools (`pagedkv.ops.store`; nothing already stored
is touched) and returns the new K/V tagged with the layer; the attention function then runs
`pagedkv.ops.prefill_attention` (T > 1) or `decode_attention` (T == 1), which read the codes
through the block tables. Every query, including those of a prompt, attends to compressed K/V,
exactly as in decoding. Without a PagedKVCache (plain forward, or transformers' own cache), the
function computes exact fp32 attention on the K/V it is given, so a model switched to "pagedkv"
still runs everywhere.

Storage: one block table per batch row; one block id addresses the same slots of every layer
(K and V pools per layer, sized from the catalogue, per-layer formats from `CacheConfig`:
high-precision first/last layers, sliding windows). The pools grow by doubling when blocks run
out unless `max_tokens` fixes the capacity (then CacheFull). Rows share full blocks after a beam
reorder / repeat (reference counts); a shared block is copied before it is written.

Key centring (on by default for non-bf16 K): on its first update a layer fixes
`k_centre` from that first chunk per KV head (float32 [H, D], see `calibration.key_centre`: for fp8 K a
per-channel mean of the chunk's keys without the ~3% farthest from the median (the sink/BOS
tokens), else the per-channel median, robust to the sinks' outlier keys); stored keys are
k - k_centre and attention adds q . k_centre back, which softmax makes exact. It removes the
large shared component of keys (the RoPE-rotated bias most models have) before quantization.

Limitations: rows of a batch must have the same length (no padding mask: a padded 2D
attention_mask raises InvalidInput); `torch.compile` is not supported.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

import torch

from ..cache.config import CacheConfig
from ..errors import CacheFull, ConfigError, InvalidInput
from ..formats import KVFormat
from ..ops import AttentionParams, PagedLayer, decode_attention, prefill_attention, store
from .calibration import CalibrationOptions, calibrate

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
# block tables


class _Blocks:
    """Block ids shared by every layer: a growable free list with reference counts, and one
    block table (list of ids) per batch row. Plain Python; the pools live in the layers."""

    def __init__(self, block_size: int, num_blocks: int, growable: bool):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.growable = growable
        self.ref = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: list[list[int]] = []
        self.version = 0  # bumps when any table changes (cached tensors are rebuilt)

    def take(self, n: int, grow) -> list[int]:
        if n > len(self.free):
            if not self.growable:
                raise CacheFull(
                    f"the paged cache needs {n} more blocks of {self.block_size} tokens but has "
                    f"{len(self.free)} free of {self.num_blocks}; raise max_tokens"
                )
            new_total = max(2 * self.num_blocks, self.num_blocks + n - len(self.free))
            grow(new_total)  # resizes every layer's pools first
            self.ref += [0] * (new_total - self.num_blocks)
            self.free = list(range(new_total - 1, self.num_blocks - 1, -1)) + self.free
            self.num_blocks = new_total
        ids = [self.free.pop() for _ in range(n)]
        for b in ids:
            self.ref[b] = 1
        return ids

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0
        if self.ref[b] == 0:
            self.free.append(b)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free)


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
    kv_format: a format name / KVFormat, or one per layer.
    high_precision_layers, hp_format: the first/last N layers' format ("auto": N from the K
    codec, see `pagedkv.cache.config`); pass 0 to use `kv_format` everywhere.
    key_centring: None = on when some layer's K codec is not bf16.
    value_centring: store v - v_centre (mean value of the first chunk per KV head) and add
    v_centre to the attention output: exact because softmax weights sum to one (refused with
    attention sinks). Off by default: on SmolLM2 it raised KL (bf16k_turbo2v 0.174 vs 0.107,
    q4_0 0.073 vs 0.055 on the first eval window): the mean is skewed by outlier (sink) tokens.
    key_scaling: per-channel key multipliers fitted to the first chunk's keys and queries (see
    `calibration.channel_multipliers`). Off by default: exact, but on SmolLM2 it did not lower KL (turbo3
    0.106 vs 0.107, turbo4 0.029 vs 0.026, q4_0 0.062 vs 0.055 on the first eval window).
    block_size: tokens per block. max_tokens: None grows the pools on demand; an int fixes the
    capacity to that many tokens summed over rows (CacheFull beyond).
    device: where the pools live (default: the model's device, else cpu).
    backend: ops backend name (None = automatic). checks: the ops' value checks (NaN/Inf in K/V,
    slot ranges); False skips those scans (shape/dtype checks always run).
    """

    def __init__(self, model_or_config, kv_format: Union[str, KVFormat, Sequence] = "turbo3", *,
                 high_precision_layers: Union[int, str] = "auto", hp_format: Union[str, KVFormat] = "q8_0",
                 key_centring: Optional[bool] = None, value_centring: bool = False,
                 key_scaling: bool = False,
                 block_size: int = 16,
                 max_tokens: Optional[int] = None, device=None, backend: Optional[str] = None,
                 checks: bool = True, check_attn_implementation: bool = True):
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
        )
        if key_centring is None:
            key_centring = any(s.format.k.name != "bf16" for s in self.config.layers)
        self.key_centring = bool(key_centring)
        self.key_scaling = bool(key_scaling)
        self.value_centring = bool(value_centring)
        self.backend = backend
        self.checks = bool(checks)
        self.blocks = _Blocks(block_size, initial_blocks, growable=max_tokens is None)
        self._table_tensor: Optional[torch.Tensor] = None
        self._table_version = -1
        layers = [PagedCacheLayer(self, spec) for spec in self.config.layers]
        _, cache_utils = _transformers()
        cache_utils.Cache.__init__(self, layers=layers)

    def __new__(cls, *args, **kwargs):
        # Subclass transformers' Cache lazily so importing pagedkv never imports transformers.
        _, cache_utils = _transformers()
        concrete = _concrete_class(cls, cache_utils.Cache)
        return object.__new__(concrete)

    # ---- storage shared by the layers ---------------------------------------------------------
    @property
    def batch_rows(self) -> int:
        return len(self.blocks.tables)

    def _grow(self, new_total: int) -> None:
        for layer in self.layers:
            layer._grow(new_total)

    def _ensure_rows(self, batch: int) -> None:
        if not self.blocks.tables:
            self.blocks.tables = [[] for _ in range(batch)]
            self.blocks.version += 1
        elif batch != len(self.blocks.tables):
            raise InvalidInput(
                f"batch size {batch} differs from the cache's {len(self.blocks.tables)} rows; "
                "use a fresh PagedKVCache per batch (or batch_select_indices)"
            )

    def _slots(self, start: int, count: int, device) -> torch.Tensor:
        """Slots for positions start..start+count of every row (row-major), allocating blocks and
        copying shared blocks about to be written. int64 [rows * count]."""
        bs = self.blocks.block_size
        need = -(-(start + count) // bs)
        first_written = start // bs
        for row, table in enumerate(self.blocks.tables):
            if start % bs and first_written < len(table) and self.blocks.ref[table[first_written]] > 1:
                self._copy_on_write(row, first_written)
            if need > len(table):
                table.extend(self.blocks.take(need - len(table), self._grow))
                self.blocks.version += 1
        pos = torch.arange(start, start + count)
        tables = self.block_table_tensor(torch.device("cpu")).long()
        slots = tables[:, pos // bs] * bs + (pos % bs)[None, :]
        return slots.reshape(-1).to(device)

    def _copy_on_write(self, row: int, index: int) -> None:
        old = self.blocks.tables[row][index]
        (new,) = self.blocks.take(1, self._grow)
        for layer in self.layers:
            layer._copy_block(old, new)
        self.blocks.release(old)
        self.blocks.tables[row][index] = new
        self.blocks.version += 1

    def block_table_tensor(self, device) -> torch.Tensor:
        """int32 [rows, max_blocks] (unused entries 0)."""
        if self._table_version != self.blocks.version or self._table_tensor is None:
            width = max((len(t) for t in self.blocks.tables), default=0)
            t = torch.zeros(len(self.blocks.tables), max(width, 1), dtype=torch.int32)
            for r, ids in enumerate(self.blocks.tables):
                if ids:
                    t[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            self._table_tensor = t
            self._table_version = self.blocks.version
        return self._table_tensor.to(device)

    def _flush(self) -> None:
        for layer in self.layers:
            layer.flush()

    def _rearrange_rows(self, sources: Sequence[int]) -> None:
        """New row i = old row sources[i]; full blocks are shared (refcounted), a shared partial
        block is copied when it is next written."""
        self._flush()
        old = self.blocks.tables
        new = []
        for s in sources:
            ids = list(old[s])
            for b in ids:
                self.blocks.ref[b] += 1
            new.append(ids)
        for ids in old:
            for b in ids:
                self.blocks.release(b)
        self.blocks.tables = new
        self.blocks.version += 1

    def _truncate(self, length: int) -> None:
        need = -(-length // self.blocks.block_size)
        for table in self.blocks.tables:
            while len(table) > need:
                self.blocks.release(table.pop())
        self.blocks.version += 1

    # ---- transformers Cache API ---------------------------------------------------------------
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._rearrange_rows([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rearrange_rows([r for r in range(self.batch_rows) for _ in range(int(repeats))])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rearrange_rows([int(i) for i in torch.as_tensor(indices).reshape(-1).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        """Negative n removes -n tokens; n >= 0 keeps the first n tokens (legacy form)."""
        self._flush()
        length = self.get_seq_length()
        keep = length + tokens_to_remove if tokens_to_remove < 0 else min(tokens_to_remove, length)
        keep = max(keep, 0)
        for layer in self.layers:
            layer.length = min(layer.length, keep)
        self._truncate(keep)

    def reset(self) -> None:
        self._truncate(0)
        self.blocks.tables = []
        self.blocks.version += 1
        for layer in self.layers:
            layer.reset()

    @property
    def is_compileable(self) -> bool:
        return False

    # ---- memory accounting ------------------------------------------------------------------
    def pool_bytes(self) -> int:
        """Bytes of every layer's K and V pools as allocated now (plus fp8 scales / centres)."""
        return sum(layer.pool_bytes() for layer in self.layers)

    def used_bytes(self) -> int:
        """Bytes of the blocks rows hold now."""
        return self.blocks.used * self.config.bytes_per_block

    def bytes_per_token(self) -> float:
        """KV bytes one token takes over all layers (exact catalogue sizes)."""
        return self.config.bytes_per_block / self.config.block_size

    @property
    def layer_formats(self) -> tuple[KVFormat, ...]:
        return self.config.layer_formats


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

    `length`: tokens stored (every row has the same length). `paged`: the ops' PagedLayer (pools,
    codecs, fp8 scales, key centre), rebuilt when the pools grow or the centre is fixed.
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
        self.pending = None  # (k, v, start) of a first chunk waiting for its queries
        self.scale_keys = cache.key_scaling and spec.format.k.name != "bf16"
        self.centre_values = cache.value_centring and spec.format.v.name != "bf16"
        self.v_centre: Optional[torch.Tensor] = None  # float32 [H, D]
        self.device = cache.config.device

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

    def _grow(self, new_total: int) -> None:
        if self.paged is None:
            return
        p = self.paged
        k = torch.zeros(new_total, p.k_pool.shape[1], dtype=torch.uint8, device=p.device)
        v = torch.zeros(new_total, p.v_pool.shape[1], dtype=torch.uint8, device=p.device)
        k[: p.num_blocks] = p.k_pool
        v[: p.num_blocks] = p.v_pool
        self.paged = replace(p, k_pool=k, v_pool=v)

    def _copy_block(self, src: int, dst: int) -> None:
        if self.paged is not None:
            self.paged.k_pool[dst] = self.paged.k_pool[src]
            self.paged.v_pool[dst] = self.paged.v_pool[src]

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
        p = self._make(self.cache.blocks.num_blocks)
        options = CalibrationOptions(key_centring=self.cache.key_centring, key_scaling=self.scale_keys,
                                     value_centring=self.centre_values)
        cal = calibrate(key_states, value_states, query_states, p.k_codec.name, p.v_codec.name,
                        options, p.device)
        self.k_mult, self.v_centre = cal.k_mult, cal.v_centre
        changes = {name: getattr(cal, name) for name in ("k_centre", "k_scale", "v_scale")
                   if getattr(cal, name) is not None}
        self.paged = replace(p, **changes) if changes else p
        self.is_initialized = True

    def _store(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int) -> None:
        b, h, t, d = key_states.shape
        slots = self.cache._slots(start, t, self.paged.device)
        k = key_states.transpose(1, 2).reshape(b * t, h, d)
        if self.k_mult is not None:
            k = k.float() * self.k_mult
        v = value_states.transpose(1, 2).reshape(b * t, h, d)
        if self.v_centre is not None:
            v = v.float() - self.v_centre
        store(self.paged, k, v, slots, backend=self.cache.backend, checks=self.cache.checks)

    def flush(self, query_states: Optional[torch.Tensor] = None) -> None:
        """Store the chunk held back for its queries' statistics (first chunk of a layer)."""
        if self.pending is None:
            return
        k, v, start = self.pending
        self.pending = None
        self.lazy_initialization(k, v, query_states)
        self._store(k, v, start)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens' K/V (float [B, H, T, D]) compressed; return them tagged with this
        layer for the attention function (nothing stored is read back here).

        With key scaling the layer's first chunk is held back until the attention function
        has seen its queries (`flush`), then stored before any attention reads it."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise InvalidInput(
                f"layer {self.spec.index}: expected keys and values [B, H, T, D] of one shape, got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        b, h, t, d = key_states.shape
        self.cache._ensure_rows(b)
        self.flush()  # attention never ran for a held-back chunk: fix stats from keys alone
        if t:
            if not self.is_initialized and self.scale_keys:
                self.pending = (key_states, value_states, self.length)
            else:
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                self._store(key_states, value_states, self.length)
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
                            attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                            dropout: float = 0.0, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, s_aux: Optional[torch.Tensor] = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function ("pagedkv").

    query float [B, Hq, Tq, D]; key/value float [B, H, Tk, D] as returned by the cache. With a
    PagedKVCache layer, attention reads the compressed pages; otherwise it is exact fp32
    attention over `key`/`value` (bottom-right causal). Returns ([B, Tq, Hq, D], None).
    """
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if softcap is None:
        softcap = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    sinks = s_aux.float() if s_aux is not None else None
    layer: Optional[PagedCacheLayer] = getattr(key, _TAG, None)
    if layer is None:
        window = sliding_window
        return _dense_attention(query, key, value, scaling, window, softcap, sinks), None
    layer.flush(query)  # a first chunk held back for its queries' statistics is stored now
    if layer.k_mult is not None:  # q . k == (q / m) . (k * m): stored keys are k * m
        g = query.shape[1] // layer.k_mult.shape[0]
        query = (query.float() / layer.k_mult.repeat_interleave(g, dim=0)[None, :, None, :]).to(query.dtype)
    if layer.v_centre is not None and sinks is not None:
        raise ConfigError("value centring is not exact with attention sinks (their weight takes no "
                          "value); create the PagedKVCache with value_centring=False")
    window = sliding_window if sliding_window is not None else layer.sliding_window
    params = AttentionParams(scale=float(scaling), sliding_window=window, soft_cap=softcap, sinks=sinks)
    b, hq, tq, d = query.shape
    cache = layer.cache
    tables = cache.block_table_tensor(query.device)
    seq_lens = torch.full((b,), layer.length, dtype=torch.int32, device=query.device)
    q = query.transpose(1, 2)  # [B, Tq, Hq, D]
    if tq == 1:
        out = decode_attention(q[:, 0].contiguous(), layer.paged, tables, seq_lens, params,
                               backend=cache.backend, checks=cache.checks)
        out = out[:, None]
    else:
        qsl = torch.arange(b + 1, dtype=torch.int32, device=query.device) * tq
        out = prefill_attention(q.reshape(b * tq, hq, d).contiguous(), layer.paged, tables, seq_lens,
                                qsl, params, backend=cache.backend, checks=cache.checks)
        out = out.reshape(b, tq, hq, d)
    if layer.v_centre is not None:  # sum_j p_j (v_j - c) + c, the weights summing to one
        g = hq // layer.v_centre.shape[0]
        out = out.float() + layer.v_centre.repeat_interleave(g, dim=0)
    return out.to(query.dtype), None


def _dense_attention(query, key, value, scaling, window, softcap, sinks):
    """Exact fp32 attention, bottom-right causal: query [B, Hq, Tq, D], key/value [B, H, Tk, D]
    -> [B, Tq, Hq, D]."""
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
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sk = sinks.reshape(1, h, g, 1, 1).expand(b, h, g, tq, 1)
        s = torch.cat([s, sk], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.einsum("bhgtn,bhnd->bhgtd", p, value.float())
    return out.reshape(b, hq, tq, d).transpose(1, 2).to(query.dtype)


def _pagedkv_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs):
    """Mask interface for "pagedkv": causal and sliding masks are applied inside the ops, so no
    mask tensor is built; a padded 2D mask is refused (rows must have equal lengths)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise InvalidInput(
            "attn_implementation='pagedkv' does not support padded batches yet (the 2D "
            "attention_mask has zeros); run rows of equal length or one row at a time"
        )
    return None


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
