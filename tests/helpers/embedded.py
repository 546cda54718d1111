"""The embedded SmolLM2 for the drop-in tests (real weights, offline; ~15-20 s to load)."""

from __future__ import annotations

import os

import pytest


def embedded_lm(attn_implementation: str = "sdpa"):
    """The loaded model (tokenizer, model), or a pytest skip when it is not installed."""
    from pagedkv.eval.model import embedded_model_source, load_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        source = embedded_model_source()
    except Exception as exc:  # pragma: no cover - depends on the install
        pytest.skip(f"embedded model not installed: {exc}")
    return load_model(source, attn_implementation=attn_implementation)
