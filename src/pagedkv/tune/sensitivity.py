"""Per-layer, per-side sensitivity of a model's attention to each codec, on calibration text.

One fp32 forward records every attention layer's queries, keys and values (after RoPE). For a
layer, a side (K or V) and a codec, the statistics the cache would fit are computed
(`cache.calibration.calibrate`: key centre, value centre, fp8 scales), only that side is
round-tripped through the codec, and the error is the mean squared difference of the layer's
causal attention output from the exact one, relative to the output's mean square. With a
high-precision window (`ops.recent.RecentWindow`: the last R positions of each query and the first
S, the sinks, read from a tail in the window's codec), the keys/values a query reads from the tail
are round-tripped through the tail codec instead, as the cache stores them. Everything is seeded or
exact, so the numbers are the same on every run (a test).
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


def window_mask(t: int, recent: int, sinks: int = 0, device=None) -> torch.Tensor:
    """bool [T, T] (query x key): the keys a query at position p reads from a high-precision tail,
    p - recent < j or j < sinks (causality is applied separately)."""
    pos = torch.arange(t, device=device)
    return (pos[None, :] > pos[:, None] - recent) | (pos[None, :] < sinks)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hp=None) -> torch.Tensor:
    """Causal fp32 attention: q [Hq, T, D], k/v [H, T, D] (GQA) -> [Hq, T, D]. hp: None, or
    (mask bool [T, T], k_hp, v_hp): where the mask is set the key/value is read from k_hp / v_hp."""
    g = q.shape[0] // k.shape[0]
    if hp is None:
        kk, vv = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    mask, k_hp, v_hp = hp
    rep = [x.repeat_interleave(g, 0) for x in (k, v, k_hp, v_hp)]
    s = torch.where(mask, q @ rep[2].mT, q @ rep[0].mT) * q.shape[-1] ** -0.5
    t = q.shape[1]
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return (p * ~mask) @ rep[1] + (p * mask) @ rep[3]


def _fit_roundtrip(codec: Codec, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor):
    """(centred round trip of k, of v, key centre [H, D], value centre [H, D]) with the
    statistics the cache fits for `codec` on both sides."""
    cal = calibrate(k[None], v[None], q[None], codec.name, codec.name,
                    CalibrationOptions(key_centring=True, key_scaling=False, value_centring=True), "cpu")
    kc = cal.k_centre if cal.k_centre is not None else torch.zeros_like(k[:, 0])
    vc = cal.v_centre if cal.v_centre is not None else torch.zeros_like(v[:, 0])
    ks = None if cal.k_scale is None else float(cal.k_scale)
    vs = None if cal.v_scale is None else float(cal.v_scale)
    kq = codec_ref.roundtrip(codec, (k - kc[:, None]).transpose(0, 1), ks).transpose(0, 1) + kc[:, None]
    vq = codec_ref.roundtrip(codec, (v - vc[:, None]).transpose(0, 1), vs).transpose(0, 1) + vc[:, None]
    return kq, vq, kc, vc


def _tail_roundtrip(codec: Codec, x: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """x [H, T, D] as a tail in `codec` stores it (relative to the layer's centre)."""
    return codec_ref.roundtrip(codec, (x - centre[:, None]).transpose(0, 1)).transpose(0, 1) + centre[:, None]


def _stores(codec: Codec, head_dim: int) -> bool:
    try:
        codec.check_head_dim(head_dim)
    except ConfigError:
        return False
    return True


def side_errors(layers: Sequence[tuple], ladder: Sequence[Codec], window=None) -> list[dict]:
    """Per layer {"k": {codec: error}, "v": {codec: error}} (relative output MSE, see module doc;
    only the codecs the layer's head_dim can store); window: None or an `ops.recent.RecentWindow` (its tail read for the positions it covers)."""
    return window_errors(layers, ladder, [window])[0]


def window_errors(layers: Sequence[tuple], ladder: Sequence[Codec], windows: Sequence) -> list[list[dict]]:
    """`side_errors` for each of `windows` (None or a RecentWindow): per layer the exact logits and
    weights once, per codec its round trips and quantized logits once, per tail codec the tail's
    logits once; per window only the mixing (the same numbers as `_attention` with each mask)."""
    out: list[list[dict]] = [[] for _ in windows]
    for q, k, v in layers:
        for o, row in zip(out, _layer_errors(q, k, v, ladder, windows)):
            o.append(row)
    return out


def _layer_errors(q, k, v, ladder: Sequence[Codec], windows: Sequence) -> list[dict]:
    g, t = q.shape[0] // k.shape[0], k.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()

    def logits(keys):
        return (q @ keys.repeat_interleave(g, 0).mT * q.shape[-1] ** -0.5).masked_fill(~causal, float("-inf"))

    p_exact = torch.softmax(logits(k), dim=-1)
    v_rep = v.repeat_interleave(g, 0)
    exact = p_exact @ v_rep
    norm = float(exact.square().mean()) or 1.0
    masks = [None if w is None else window_mask(t, w.tokens, w.sinks, q.device) for w in windows]
    rows = [{"k": {}, "v": {}} for _ in windows]
    for codec in ladder:
        if not _stores(codec, k.shape[-1]):
            continue  # this layer's head_dim: not a rung here
        kq, vq, kc, vc = _fit_roundtrip(codec, k, v, q)
        s_q, vq_rep, tails = logits(kq), vq.repeat_interleave(g, 0), {}
        for w, mask, row in zip(windows, masks, rows):
            if w is None:
                k_out, v_out = torch.softmax(s_q, dim=-1) @ v_rep, p_exact @ vq_rep
            else:  # the tail holds both sides in its codec, relative to the same centres
                if w.codec.name not in tails:
                    tails[w.codec.name] = (logits(_tail_roundtrip(w.codec, k, kc)),
                                           _tail_roundtrip(w.codec, v, vc).repeat_interleave(g, 0))
                s_t, vt_rep = tails[w.codec.name]
                k_out = torch.softmax(torch.where(mask, s_t, s_q), dim=-1) @ v_rep
                v_out = (p_exact * ~mask) @ vq_rep + (p_exact * mask) @ vt_rep
            row["k"][codec.name] = float((k_out - exact).square().mean()) / norm
            row["v"][codec.name] = float((v_out - exact).square().mean()) / norm
    return rows
