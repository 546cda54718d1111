"""The calibration text and the attention capture shared by `pagedkv tune` and the vLLM fit.

Both fit or measure on fixed text that is not the evaluation text: the docstrings of a fixed,
ordered list of standard-library modules (`calibration_text`), tokenized with BOS first when the
tokenizer has one (`calibration_ids`). `capture_attention` runs one transformers forward in
which every attention layer's queries, keys and values (after RoPE, float32) are recorded through
transformers' attention interface (then computed by sdpa, so the forward is the model's own):
`attention_hook`, the one place an attention implementation is registered, set and restored
(also used by tune's needle gradients).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch

from ..errors import ConfigError

# fixed, ordered: the calibration text never changes with the request stream
CALIBRATION_MODULES = ("collections", "functools", "itertools", "json", "pathlib", "argparse",
                       "logging", "threading", "dataclasses", "contextlib", "heapq", "bisect",
                       "textwrap", "fractions", "decimal", "string", "datetime", "subprocess")
CAPTURE = "pagedkv_capture"  # the attention implementation name the capture registers


def calibration_text() -> str:
    """Docstrings of CALIBRATION_MODULES, joined by blank lines."""
    import importlib

    parts = []
    for name in CALIBRATION_MODULES:
        doc = inspect.getdoc(importlib.import_module(name))
        if doc:
            parts.append(doc)
    return "\n\n".join(parts)


def calibration_ids(tokenizer, tokens: int, text: Optional[str] = None, what: str = "") -> list[int]:
    """The first `tokens` token ids of `text` (default: `calibration_text()`), BOS first when the
    tokenizer has one; ConfigError naming `what` (the setting, e.g. "--tokens 512") when the text
    is shorter."""
    ids = tokenizer(calibration_text() if text is None else text, add_special_tokens=False)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = ([int(bos)] if bos is not None else []) + list(ids)
    if len(ids) < tokens:
        raise ConfigError(f"{what or tokens}: the calibration text has only {len(ids)} tokens")
    return ids[:tokens]


@contextlib.contextmanager
def attention_hook(model, name: str, see):
    """For the body of the `with`, every attention layer of the transformers `model` calls
    `see(module, query, key, value, kwargs) -> (key, value)` and then sdpa on what it returns
    (the model's own attention): `see` is registered as attention implementation `name` (with
    sdpa's mask) and set; the model's implementation is restored on exit."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attend(module, query, key, value, attention_mask, **kwargs):
        key, value = see(module, query, key, value, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, attend)
    AttentionMaskInterface.register(name, sdpa_mask)
    before = getattr(model.config, "_attn_implementation", None)
    if before != name:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if before is not None and before != name:
            model.set_attn_implementation(before)


def logit_rows(model, rows) -> dict:
    """The forward keyword that computes the LM head at `rows` only (an int: the last rows; a
    1-D index tensor: those positions), where the model's forward takes transformers'
    `logits_to_keep`; else none (all rows). The capture needs no logits and the needle gradient
    a few: the whole head of a long window is the largest tensor of the forward (16k positions
    of Gemma-3's 262k-word vocabulary: 17 GB in float32)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"logits_to_keep": rows} if "logits_to_keep" in params else {}


def capture_attention(model, ids: torch.Tensor) -> list[tuple]:
    """(q [B, Hq, T, D], k [B, H, T, D], v [B, H, T, D] float32, sliding window or None, softmax
    scale or None, as the layer's module has them) of every attention layer of a loaded
    transformers model for ids int64 [B, T], in layer order (its attention implementation is
    restored afterwards)."""
    seen: dict[int, tuple] = {}

    def record(module, query, key, value, kwargs):
        qkv = tuple(x.detach().float().clone() for x in (query, key, value))
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        scale = kwargs.get("scaling", getattr(module, "scaling", None))
        seen[int(module.layer_idx)] = (*qkv, int(window) if window else None, None if scale is None else float(scale))
        return key, value

    with attention_hook(model, CAPTURE, record), torch.no_grad():
        model(ids.to(model.device), use_cache=False, **logit_rows(model, 1))
    if not seen:
        raise ConfigError("the model ran no attention layer through transformers' attention interface")
    return [seen[i] for i in sorted(seen)]
