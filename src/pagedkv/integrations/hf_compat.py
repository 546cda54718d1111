"""The keyword a transformers model takes its cache by: `cache=` from transformers 5.2x on,
`past_key_values=` before (5.19, the version vLLM's CPU build pins, swallows an unknown
`cache=` in **kwargs and runs on its own DynamicCache: a PagedKVCache passed that way would be
silently unused)."""

from __future__ import annotations

import inspect

from ..errors import ConfigError


def cache_keyword(model) -> str:
    """"cache" or "past_key_values", whichever `model.forward` declares; ConfigError otherwise."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ConfigError(f"{type(model).__name__}.forward takes neither cache= nor past_key_values= "
                      f"(its parameters: {', '.join(params)}); pagedkv needs a model that takes a "
                      f"transformers Cache")


def with_cache(model, cache) -> dict:
    """The keyword arguments that hand `cache` to `model(...)` / `model.generate(...)`."""
    return {cache_keyword(model): cache}
