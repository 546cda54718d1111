"""Shared pieces of the transformers drop-in: the lazy transformers import, the model's layer
layout, the model identity for shared prefix keys, the read-only view of a block group, and the
lazy subclassing that keeps `import pagedkv` free of transformers.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError
from .model_config import text_config

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
    text = text_config(config)
    if getattr(text, "kv_lora_rank", None):  # MLA caches one latent per token, not K/V per head
        raise ConfigError(
            f"{type(text).__name__} uses latent attention (MLA); use "
            "pagedkv.integrations.deepseek.PagedLatentCache (and deepseek.enable(model))"
        )
    types, kwargs = cache_utils.get_layer_types_and_kwargs(text)
    if isinstance(kwargs, dict):  # older transformers (5.17 seen; 5.25 gives a list): one dict for every layer
        kwargs = [kwargs] * len(types)
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


def _model_identity(model_or_config) -> str:
    """What names the model in shared prefix keys: a hash of its weights when they are at hand
    (`pagedkv.offload.weights_identity`), else its config's name and dims."""
    if isinstance(model_or_config, torch.nn.Module):
        from ..offload.identity import weights_identity

        return weights_identity(model_or_config)
    config = getattr(model_or_config, "config", model_or_config)
    return "|".join(str(getattr(config, k, "")) for k in ("_name_or_path", "model_type",
                                                            "hidden_size", "num_hidden_layers"))


class GroupView:
    """Read-only view of one block group of a PagedKVCache (tests, accounting): its window,
    layers (whose pages it holds), tails (layers whose recent-window tail it holds), and per row
    its table (-1 = released by the window) and released count. Given the engine's block manager
    `core` and the drop-in's `BatchRows` (`rows.ids`: each row's sequence), never the cache."""

    def __init__(self, core, rows, index: int, window: Optional[int], layers: list[int],
                 tails: Optional[list[int]] = None):
        self.core, self.rows, self.index, self.window, self.layers = core, rows, index, window, layers
        self.tails = tails or []

    @property
    def seqs(self):
        return self.core.groups[self.index]

    @property
    def tables(self) -> list[list[int]]:
        return [list(self.seqs.table(s)) for s in self.rows.ids]

    @property
    def dead(self) -> list[int]:
        return [self.seqs.dead(s) for s in self.rows.ids]

    @property
    def used(self) -> int:
        return self.seqs.pool.num_used

    @property
    def num_blocks(self) -> int:
        return self.seqs.pool.num_blocks


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


def _engine_fields(model_or_config, opts, max_tokens: Optional[int], device, offload) -> dict:
    """The `CacheConfig` fields both drop-ins set alike: the options (block size, hp format,
    window, reclaim, kept window prefixes, key centring: `CacheConfig(options=)`); with
    max_tokens every group capped at that many tokens' blocks, else pools that grow on demand;
    the pools on `device` (default: the model's); the model's identity in the prefix keys with
    offload tiers; slots unchecked (the adapter stores only those handed out)."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens <= 0):
        raise ConfigError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
    cap = -(-max_tokens // opts.block_size) if max_tokens else None
    return dict(options=opts, num_blocks=cap or 16, grow_blocks=cap is None,
                device=device or _model_device(model_or_config),
                model_id=_model_identity(model_or_config) if offload is not None else "", check_slots=False)


def _note_input_ids(module, args, kwargs):
    """Forward pre-hook: hand the forward's input_ids to the PagedKVCache it runs with, so the
    chunk's blocks are keyed by their token ids (prefix hits across `generate` calls)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if getattr(cache, "_pagedkv_rows", False):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache.rows.next_ids = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _watch_input_ids(model) -> None:
    if hasattr(model, "register_forward_pre_hook") and not getattr(model, "_pagedkv_ids_hook", False):
        model.register_forward_pre_hook(_note_input_ids, with_kwargs=True)
        model._pagedkv_ids_hook = True
