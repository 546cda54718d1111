"""DeepSeek-V2/V3 multi-head latent attention (MLA) on the paged, compressed cache (transformers 5.x).

Usage:

    from pagedkv.integrations.deepseek import PagedLatentCache, enable
    enable(model)                                   # MLA attention modules run absorbed attention
    cache = PagedLatentCache(model, "turbo4")       # one [latent | rope] pool per layer
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

What is cached: per token and layer, the latent `compressed_kv` after `kv_a_layernorm`
(kv_lora_rank dims) and the rotary key `k_pe` after RoPE (qk_rope_head_dim dims), shared by
every head (`pagedkv.cache.latent`, `pagedkv.ops.latent_layer`): bytes per token are per latent,
not per head.

How attention runs. transformers' own forward expands the whole cached latent into per-head K/V
with `kv_b_proj` at every step. `enable(model)` replaces the forward of each MLA attention module
(instances only; the class is untouched) by one that, when the cache is a `PagedLatentCache`,
stores the new tokens' latent and rope key, then runs absorbed attention on the pages:
`q_lat_h = W_UK_h^T q_nope_h` (W_UK_h: the key rows of `kv_b_proj` for head h, [nope, L]),
logits `scale * (q_lat . c + q_rope . k_rope)` (`pagedkv.ops.latent`), output
`o_h = W_UV_h (sum_j p_j c_j)` (W_UV_h: the value rows), then `o_proj`. The absorption runs in
the model's dtype (like transformers' own projections), the attention in fp32. With any other cache (or none) the original forward runs unchanged.

Padded batches (left padding for `generate`, right padding for a plain forward, as
`PagedKVCache`): the mask the attention module receives (transformers' prepared 4D causal mask
for eager / sdpa, or a 2D `PaddingMask` under attn_implementation="pagedkv") says which columns
are tokens (`padding.mask_columns`); pad columns are never stored, row r holds only its real
tokens, packed, and its real queries attend to them (pad queries output zeros, which
transformers discards); the fp8 scales are fitted to the first chunk's real tokens. Positions
come from transformers (from the mask in `generate`). `get_seq_length()` counts columns, pads
included; `row_lengths(columns)` gives each row's stored count.

Limitations: a 4D mask must be exactly the causal mask of a padded batch (a custom mask
function or a sliding-window mask raises InvalidInput; the past columns must be those the cache
stored, as `generate` passes them); `torch.compile` is not supported; the cache refuses
`update()` (only the patched forward may write it, so an unpatched model cannot silently attend
to the new tokens only).
"""

from __future__ import annotations

import sys
import types
from typing import Optional, Sequence, Union

import torch

from ..cache.config import CacheConfig
from ..cache.latent import LatentLayout
from ..options import CacheOptions, option_names
from ..errors import ConfigError, InvalidInput
from ..formats import KVFormat
from ..ops import AttentionParams
from .hf_common import _engine_fields
from .model_config import text_config
from .padding import mask_columns, pack
from .transformers import PagedCacheLayer, PagedKVCache

_ORIGINAL = "_pagedkv_original_forward"
_PATCHED = "_pagedkv_mla_patched"  # on the model `enable` ran on: the modules it patched


def mla_dims(config) -> Optional[tuple[int, int]]:
    """(kv_lora_rank, qk_rope_head_dim) of an MLA model's HF config, or None for other models."""
    text = text_config(config)
    lat = getattr(text, "kv_lora_rank", None)
    rope = getattr(text, "qk_rope_head_dim", None)
    if isinstance(lat, int) and isinstance(rope, int) and lat > 0 and rope > 0:
        return lat, rope
    return None


def latent_config(model_or_config, kv_format="bf16", *, rope_format: Optional[str] = None,
                  **config_kwargs) -> CacheConfig:
    """The `CacheConfig` of an MLA model's latent layers (its layer count, kv_lora_rank and
    qk_rope_head_dim); config_kwargs: the rest (num_blocks or memory_bytes, block_size, ...).
    The drop-in `PagedLatentCache` and the engine loop (`deepseek_engine`) both build theirs here."""
    config = getattr(model_or_config, "config", model_or_config)
    dims = mla_dims(config)
    if dims is None:
        raise ConfigError(f"{type(config).__name__} has no latent attention (kv_lora_rank, "
                          "qk_rope_head_dim); use pagedkv.integrations.transformers.PagedKVCache for K/V models")
    return CacheConfig(num_layers=int(text_config(config).num_hidden_layers), num_kv_heads=1,
                       head_dim=dims[0] + dims[1], kv_format=kv_format,
                       latent=LatentLayout(dims[0], dims[1], rope_format), **config_kwargs)


class AbsorbedCache:
    """What the absorbed MLA forward (`enable`) asks of a cache; two front doors implement it:
    the drop-in `PagedLatentCache` (a transformers Cache, padded rows) and the engine's
    `deepseek_engine.EngineStep` (one forward over sequences of a `pagedkv.cache.PagedCache`)."""

    def mla_store(self, layer_idx: int, latent: torch.Tensor, rope: torch.Tensor,
                  attention_mask) -> None:
        """Store the new tokens: latent float [B, T, L] (after kv_a_layernorm), rope float
        [B, T, R] (after RoPE)."""
        raise NotImplementedError

    def mla_window(self, layer_idx: int) -> Optional[int]:
        """The layer's sliding window (None: full attention)."""
        raise NotImplementedError

    def mla_attend(self, layer_idx: int, q_lat: torch.Tensor, q_rope: torch.Tensor,
                   params: AttentionParams) -> torch.Tensor:
        """Attention of q_lat float32 [B, T, H, L], q_rope [B, T, H, R] on the stored rows
        (the new tokens included) -> [B, T, H, L]."""
        raise NotImplementedError


# K/V-model options that do not apply to a latent (the latent is both key and value)
_KV_ONLY_OPTIONS = {"key_centring", "value_centring", "key_scaling", "recent_window", "approx", "reclaim_sliding"}


class PagedLatentCache(PagedKVCache, AbsorbedCache):
    """A transformers `Cache` holding each layer's `[latent | rope]` per token compressed in pages.

    model_or_config: an MLA model (DeepSeek-V2/V3 family) or its HF config.
    kv_format: a format name / KVFormat or one per layer (the latent takes the more precise codec
    of the pair, see `pagedkv.cache.latent`). rope_format: None = auto (measured), "same", or a
    codec name. high_precision_layers / max_tokens / device, and of the options (`CacheOptions`
    or keywords) hp_format / block_size / backend / checks: as `PagedKVCache` (backend: a
    `pagedkv.ops.latent` backend name; the K/V-only options are refused). offload /
    swap_tier / prefix_tier: the resident cap and the shared prefix store, as `PagedKVCache`
    (`cache.begin(ids)` before `generate` takes the prefix hits; a layer's record is its latent
    pool block, its stored transform the fp8 scales).
    """

    def __init__(self, model_or_config, kv_format: Union[str, KVFormat, Sequence] = "bf16", *,
                 rope_format: Optional[str] = None, high_precision_layers: Union[None, int, str] = None,
                 max_tokens: Optional[int] = None, device=None, offload=None, swap_tier=None, prefix_tier=None,
                 options: Optional[CacheOptions] = None, **option_fields):
        opts = CacheOptions.of(options, **option_fields)
        kv_only = sorted(set(opts.changed()) & _KV_ONLY_OPTIONS)
        if kv_only:
            raise ConfigError(f"{', '.join(kv_only)}: not implemented for latent (MLA) layers; accepted here: "
                              f"{', '.join(sorted(set(option_names()) - _KV_ONLY_OPTIONS))}")
        self.config = latent_config(model_or_config, kv_format, rope_format=rope_format,
                                    high_precision_layers=high_precision_layers,
                                    **_engine_fields(model_or_config, opts, max_tokens, device, offload))
        # the engine cache of latent layers (one global block group); token ids key the blocks
        self._open(model_or_config, self.config, opts, LatentCacheLayer, offload, swap_tier, prefix_tier)

    def mla_store(self, layer_idx, latent, rope, attention_mask) -> None:
        layer: LatentCacheLayer = self.layers[layer_idx]
        b, t, _ = latent.shape
        valid = self._chunk_validity(attention_mask, b, t, layer.length)  # before any change
        layer.store_latent(latent, rope, valid)

    def _chunk_validity(self, attention_mask, batch: int, tq: int, start: int):
        """Which of the chunk's tokens are real (bool [B, T] on cpu, None = all), from the mask
        the attention module received (`padding.mask_columns`); its past columns must be those
        the cache stored (as `generate` passes them), else InvalidInput before any change."""
        cols = mask_columns(attention_mask, batch, tq, start + tq)
        if self.rows.ids and batch != len(self.rows.ids):
            self.rows.ensure(batch)  # raises: a batch of another size
        self.rows.columns.check_past(None if cols is None else cols[:, :start], batch, start)
        if cols is None:
            return None
        chunk = cols[:, start:]
        return None if bool(chunk.all()) else chunk

    def mla_window(self, layer_idx: int) -> Optional[int]:
        return self.layers[layer_idx].sliding_window

    def mla_attend(self, layer_idx, q_lat, q_rope, params) -> torch.Tensor:
        """Each row's real queries attend to that row's stored tokens (bottom-right causal),
        through the engine (swapped blocks read back); pad queries get zeros (transformers
        discards them)."""
        layer: LatentCacheLayer = self.layers[layer_idx]
        kw = dict(backend=self.backend, checks=self.checks)
        e, rows = self.engine, self.rows.ids
        return self.rows.attend(
            (q_lat, q_rope), layer.chunk_valid,
            lambda ql, qr: e.latent_decode_attention(layer_idx, ql, qr, rows, params, **kw),
            (lambda ql, qr, qsl: e.latent_prefill_attention(layer_idx, ql, qr, rows, qsl, params, **kw))
            if layer.is_initialized else None)


class LatentCacheLayer(PagedCacheLayer):
    """One model layer's paged latent (`paged`: the engine's LatentLayer of this layer, None
    until its first chunk fixed the fp8 scales; `chunk_valid`: which tokens of the chunk being
    run are real, bool [B, T] or None = all)."""

    chunk_valid: Optional[torch.Tensor] = None

    def __repr__(self):
        return f"LatentCacheLayer({self.spec.index}, {self.spec.latent.name}, len={self.length})"

    def pool_bytes(self) -> int:
        return 0 if self.paged is None else self.paged.pool.numel() + 8

    def lazy_initialization(self, *args, **kwargs) -> None:
        """The fp8 scales are fixed by the layer's first store, in the engine (`store_latent`)."""

    def update(self, *args, **kwargs):
        raise InvalidInput(
            "PagedLatentCache is written by the absorbed MLA attention only: call "
            "pagedkv.integrations.deepseek.enable(model) before running the model with it"
        )

    def store_latent(self, latent: torch.Tensor, rope: torch.Tensor,
                     valid: Optional[torch.Tensor] = None) -> None:
        """Store the new tokens: latent float [B, T, L] (after kv_a_layernorm) and rope float
        [B, T, R] (after RoPE); valid bool [B, T] (None = all): only real tokens are stored,
        packed after the row's stored ones (pads never are); every row advances T columns. The
        layer's first chunk with a real token fixes the fp8 scales from the real tokens (the
        engine's first store, `PagedCache.store_latent`)."""
        b, t, _ = latent.shape
        cache = self.cache
        cache.rows.ensure(b)
        self.chunk_valid = valid
        cache.rows.store(self.length, valid, b, t, lambda counts, step: cache.engine.store_latent(
            self.index, pack(latent, valid), pack(rope, valid), step(), backend=cache.backend, checks=cache.checks))
        self.length += t


# ---------------------------------------------------------------------------------------------
# the absorbed attention forward


def _absorbed_forward(self, hidden_states: torch.Tensor, position_embeddings=None,
                      attention_mask: Optional[torch.Tensor] = None, cache=None, **kwargs):
    """DeepseekV3Attention.forward with the latent cached in pages and absorbed attention (the
    cache, an `AbsorbedCache`, stores the rows and attends: either front door).

    hidden_states [B, T, hidden]; returns ([B, T, hidden], None)."""
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    else:
        kwargs.pop("past_key_values", None)
    if not isinstance(cache, AbsorbedCache):
        return type(self).forward(self, hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, cache=cache, **kwargs)
    hf = sys.modules[type(self).__module__]
    b, t = hidden_states.shape[:-1]
    nope, rd, L = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    if self.q_lora_rank is None:
        q_states = self.q_proj(hidden_states)
    else:
        q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_states = q_states.view(b, t, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, T, D]
    q_pass, q_rot = torch.split(q_states, [nope, rd], dim=-1)
    compressed = self.kv_a_proj_with_mqa(hidden_states)
    kv_nope, k_rot = torch.split(compressed, [L, rd], dim=-1)
    kv_nope = self.kv_a_layernorm(kv_nope)
    k_rot = k_rot.view(b, 1, t, rd)
    cos, sin = position_embeddings
    rope_fn = hf.apply_rotary_pos_emb_interleave if self.config.rope_interleave else hf.apply_rotary_pos_emb
    q_rot, k_rot = rope_fn(q_rot, k_rot, cos, sin)

    cache.mla_store(self.layer_idx, kv_nope, k_rot[:, 0], attention_mask)

    h = q_states.shape[1]
    # absorption in the model's dtype (as transformers' own projections; no fp32 weight copies)
    w = self.kv_b_proj.weight.view(h, nope + self.v_head_dim, L)
    q_lat = torch.einsum("bhtn,hnl->bthl", q_pass.to(w.dtype), w[:, :nope]).float()  # [B, T, H, L]
    q_rope = q_rot.float().transpose(1, 2)  # [B, T, H, R]
    params = AttentionParams(
        scale=float(self.scaling), sliding_window=cache.mla_window(self.layer_idx),
        soft_cap=getattr(self.config, "attn_logit_softcapping", None),
        sinks=None if getattr(self, "sinks", None) is None else self.sinks.float(),
    )
    o = cache.mla_attend(self.layer_idx, q_lat, q_rope, params)
    out = torch.einsum("bthl,hvl->bthv", o.to(w.dtype), w[:, nope:])  # [B, T, H, v_head_dim]
    out = out.reshape(b, t, h * self.v_head_dim).to(hidden_states.dtype)
    return self.o_proj(out), None


def _is_mla(module) -> bool:
    return all(hasattr(module, a) for a in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                                            "qk_nope_head_dim", "kv_lora_rank", "layer_idx"))


def enable(model) -> int:
    """Patch every MLA attention module of `model` (idempotent); returns how many were patched.
    Raises ConfigError when the model has none. The patched modules are noted on `model`
    (`patched_modules`), so a check per forward does not walk the whole module tree."""
    found = [module for module in model.modules() if _is_mla(module)]
    if not found:
        raise ConfigError(f"{type(model).__name__} has no MLA attention modules (kv_a_proj_with_mqa, "
                          "kv_b_proj); use pagedkv.integrations.transformers for K/V models")
    for module in found:
        if not hasattr(module, _ORIGINAL):
            setattr(module, _ORIGINAL, module.forward)
            module.forward = types.MethodType(_absorbed_forward, module)
    model.__dict__[_PATCHED] = tuple(found)
    return len(found)


def patched_modules(model) -> tuple:
    """The MLA attention modules of `model` that run the absorbed forward (empty: `enable` was
    not run, or undone). Cheap after the first call: the modules `enable` noted on `model` are
    checked (each still patched), the module tree is walked only when nothing is noted (e.g.
    `enable` ran on a submodule; the result is noted then)."""
    noted = model.__dict__.get(_PATCHED)
    if noted is None:
        noted = tuple(m for m in model.modules() if hasattr(m, _ORIGINAL))
        if not noted:
            return ()
        model.__dict__[_PATCHED] = noted
    return noted if all(hasattr(m, _ORIGINAL) for m in noted) else ()


def disable(model) -> None:
    """Undo `enable`."""
    for module in model.modules():
        if hasattr(module, _ORIGINAL):
            module.__dict__.pop("forward", None)
            delattr(module, _ORIGINAL)
        module.__dict__.pop(_PATCHED, None)
