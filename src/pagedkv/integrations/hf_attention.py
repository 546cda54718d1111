"""The "pagedkv" attention and mask functions for transformers: store the chunk's valid tokens
in the paged layer, then attend on the compressed pages (exact fp32 attention without a
PagedKVCache); `register()` / `enable(model)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..errors import ConfigError, InvalidInput
from ..ops import AttentionParams
from ..options import centres_values
from .hf_common import _TAG, ATTN_IMPLEMENTATION, _transformers
from .padding import PaddingMask, chunk_validity as _chunk_validity

if TYPE_CHECKING:
    from .hf_layer import PagedCacheLayer


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
    cache = layer.cache
    try:
        if layer.group.window is not None and (window is None or window > layer.group.window):
            raise InvalidInput(
                f"layer {layer.spec.index} attends with sliding_window={window} but its cache layer "
                f"keeps only the last {layer.group.window} tokens (the model config's window)")
        centred = layer.v_centre is not None if was_initialized else \
            cache.options.value_centring is True and centres_values(layer.spec.format, True)
        if centred and sinks is not None:
            raise ConfigError("value centring is not exact with attention sinks (their weight takes no "
                              "value); create the PagedKVCache with value_centring=False")
        valid = _chunk_validity(attention_mask, layer, b, tq)
        # store the chunk's valid tokens (the layer's first fixes its transform)
        layer.flush(query, valid, has_sinks=sinks is not None)
    except Exception:
        layer._abort(pending, was_initialized)
        raise
    params = cache.approx.apply(AttentionParams(scale=float(scaling), sliding_window=window, soft_cap=softcap,
                                                sinks=sinks))
    engine, i, rows = cache.engine, layer.index, cache.rows.ids
    if engine.tails is not None:  # the high-precision recent window (ops/recent.py): prefill, every step
        decode, kw = None, dict(checks=cache.checks)
    else:
        kw = dict(backend=cache.backend, checks=cache.checks)
        decode = lambda q: engine.decode_attention(i, q, rows, params, **kw)  # noqa: E731
    prefill = (lambda q, qsl: engine.prefill_attention(i, q, rows, qsl, params, **kw)) \
        if layer.is_initialized else None  # nothing stored yet (every token so far a pad): zeros
    return cache.rows.attend((query.transpose(1, 2),), valid, decode, prefill).to(query.dtype), None


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
