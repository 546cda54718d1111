"""Per-layer, per-side sensitivity of a model's attention to each codec, on calibration text.

One fp32 forward records every attention layer's queries, keys and values (after RoPE). For a
layer, a side (K or V) and a codec, the statistics the cache would fit are computed
(`cache.calibration.calibrate`: key centre, value centre, fp8 scales), only that side is
round-tripped through the codec, and the error is the mean squared difference of the layer's
causal attention output from the exact one, relative to the output's mean square. Everything is
seeded or exact, so the numbers are the same on every run (a test).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..codecs import reference as codec_ref
from ..codecs.catalogue import Codec
from ..errors import ConfigError
from ..cache.calibration import CalibrationOptions, calibrate

_CAPTURE = "pagedkv_tune_capture"


def capture(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q [Hq, T, D], k [H, T, D], v [H, T, D]) float32 of every attention layer for ids int64 [1, T]."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen: dict[int, tuple] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[int(module.layer_idx)] = tuple(x[0].detach().float().clone() for x in (query, key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE, record)
    AttentionMaskInterface.register(_CAPTURE, sdpa_mask)
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(_CAPTURE)
    try:
        with torch.no_grad():
            model(ids.to(model.device), use_cache=False)
    finally:
        if before is not None:
            model.set_attn_implementation(before)
    if not seen:
        raise ConfigError("tune: the model ran no attention layer through transformers' attention interface")
    return [seen[i] for i in sorted(seen)]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal fp32 attention: q [Hq, T, D], k/v [H, T, D] (GQA) -> [Hq, T, D]."""
    g = q.shape[0] // k.shape[0]
    kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)


def side_errors(layers: Sequence[tuple], ladder: Sequence[Codec]) -> list[dict]:
    """Per layer {"k": {codec: error}, "v": {codec: error}} (relative output MSE, see module doc)."""
    out = []
    for q, k, v in layers:
        exact = _attention(q, k, v)
        norm = float(exact.square().mean()) or 1.0
        row: dict = {"k": {}, "v": {}}
        for codec in ladder:
            cal = calibrate(k[None], v[None], q[None], codec.name, codec.name,
                            CalibrationOptions(key_centring=True, key_scaling=False, value_centring=True), "cpu")
            kc = cal.k_centre if cal.k_centre is not None else torch.zeros_like(k[:, 0])
            vc = cal.v_centre if cal.v_centre is not None else torch.zeros_like(v[:, 0])
            ks = None if cal.k_scale is None else float(cal.k_scale)
            vs = None if cal.v_scale is None else float(cal.v_scale)
            kq = codec_ref.roundtrip(codec, (k - kc[:, None]).transpose(0, 1), ks).transpose(0, 1) + kc[:, None]
            vq = codec_ref.roundtrip(codec, (v - vc[:, None]).transpose(0, 1), vs).transpose(0, 1) + vc[:, None]
            row["k"][codec.name] = float((_attention(q, kq, v) - exact).square().mean()) / norm
            row["v"][codec.name] = float((_attention(q, k, vq) - exact).square().mean()) / norm
        out.append(row)
    return out
