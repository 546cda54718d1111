"""Facts read from a Hugging Face model config (or a config built from GGUF metadata) without
loading weights or importing torch: the decoder's own config of a composite model, and the
context the model was trained to, which the CLI checks before anything heavy is loaded."""

from __future__ import annotations

from typing import Optional


def text_config(config):
    """The decoder (text) config of a composite config (e.g. Gemma 3's `text_config`), else `config`."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def trained_context(config) -> Optional[int]:
    """The positions the model was trained to (its text config's `max_position_embeddings`), or
    None when the config does not say (missing or 0)."""
    n = getattr(text_config(config), "max_position_embeddings", None)
    return int(n) if n else None
