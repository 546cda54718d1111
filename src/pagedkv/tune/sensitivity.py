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

from typing import Optional, Sequence

import torch

from ..codecs import reference as codec_ref
from ..codecs.catalogue import Codec
from ..errors import ConfigError
from ..cache.calibration import CalibrationOptions, calibrate
from ..integrations.capture import capture_attention

def capture(model, ids: torch.Tensor) -> list[tuple]:
    """(q [Hq, T, D], k [H, T, D], v [H, T, D] float32, sliding window or None, softmax scale) of
    every attention layer for ids int64 [1, T] (the window and scale as the layer's module has
    them: Gemma's sliding layers attend to their last 512 keys only), recorded by
    `integrations.capture`, the capture the vLLM fit uses."""
    return [(q[0], k[0], v[0], window, scale) for q, k, v, window, scale in capture_attention(model, ids)]


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


MAX_QUERY_ROWS = 256  # a longer calibration window scores this many query rows, evenly spread


def query_rows(t: int, limit: Optional[int] = None) -> torch.Tensor:
    """int64 [min(t, limit)]: every position of a window of t tokens, or `limit` (default
    MAX_QUERY_ROWS) of them evenly spread, the last included (each still attends to all its keys)."""
    limit = MAX_QUERY_ROWS if limit is None else limit
    if t <= limit:
        return torch.arange(t)
    return torch.linspace(t / limit - 1, t - 1, limit).round().long()


def window_errors(layers: Sequence[tuple], ladder: Sequence[Codec], windows: Sequence) -> list[list[dict]]:
    """`side_errors` for each of `windows` (None or a RecentWindow). layers: (q, k, v) per layer, or
    (q, k, v, sliding window or None, softmax scale) as `capture` records them. Per layer the exact
    logits and weights once, per codec its round trips and quantized logits once, per tail codec
    the tail's logits once; per window only the columns it reads from the tail (the same numbers
    as `_attention` with each mask, up to fp32 rounding). Windows longer than MAX_QUERY_ROWS score
    `query_rows` of their queries (each over every key it attends to)."""
    out: list[list[dict]] = [[] for _ in windows]
    for layer in layers:
        q, k, v = layer[:3]
        sliding, scale = (layer[3], layer[4]) if len(layer) > 3 else (None, None)
        for o, row in zip(out, _layer_errors(q, k, v, ladder, windows, sliding, scale)):
            o.append(row)
    return out


def _tail_columns(rows: torch.Tensor, t: int, recent: int, sinks: int, visible) -> tuple:
    """(idx int64 [Q, S + R], valid bool [Q, S + R]): per query row p the keys it reads from a
    tail, each once: the sinks j < S, then the band p - R < j <= p (j >= S), where `visible(p, j)`."""
    p = rows[:, None]
    cols = torch.cat([torch.arange(sinks).expand(rows.numel(), sinks), p - recent + 1 + torch.arange(recent)], 1)
    valid = torch.cat([torch.ones(rows.numel(), sinks, dtype=torch.bool), cols[:, sinks:] >= sinks], 1)
    idx = cols.clamp(0, t - 1)
    return idx, valid & (cols >= 0) & visible(p, idx)


def _layer_errors(q, k, v, ladder: Sequence[Codec], windows: Sequence, sliding=None, scale=None) -> list[dict]:
    g, t = q.shape[0] // k.shape[0], k.shape[1]
    rows = query_rows(t).to(q.device)
    qs = q[:, rows]
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def visible(p, j):  # query position p sees key j (causal, the layer's sliding window)
        ok = j <= p
        return ok if sliding is None else ok & (j > p - sliding)

    seen = visible(rows[:, None], torch.arange(t, device=q.device)[None, :])  # [Q, T]

    def logits(keys):
        return (qs @ keys.repeat_interleave(g, 0).mT * scale).masked_fill(~seen, float("-inf"))

    p_exact = torch.softmax(logits(k), dim=-1)
    v_rep = v.repeat_interleave(g, 0)
    exact = p_exact @ v_rep
    norm = float(exact.square().mean()) or 1.0
    cols = [None if w is None else _tail_columns(rows, t, w.tokens, w.sinks, visible) for w in windows]
    out = [{"k": {}, "v": {}} for _ in windows]
    for codec in ladder:
        if not _stores(codec, k.shape[-1]):
            continue  # this layer's head_dim: not a rung here
        kq, vq, kc, vc = _fit_roundtrip(codec, k, v, q)
        s_q, vq_rep, tails = logits(kq), vq.repeat_interleave(g, 0), {}
        shift = s_q.amax(-1, keepdim=True)
        e_q = torch.exp(s_q - shift)
        num, den = e_q @ v_rep, e_q.sum(-1, keepdim=True)
        base_v = p_exact @ vq_rep
        for w, c, row in zip(windows, cols, out):
            if w is None:
                k_out, v_out = num / den, base_v
            else:  # the tail holds both sides in its codec, relative to the same centres
                if w.codec.name not in tails:
                    tails[w.codec.name] = (logits(_tail_roundtrip(w.codec, k, kc)),
                                           _tail_roundtrip(w.codec, v, vc).repeat_interleave(g, 0))
                s_t, vt_rep = tails[w.codec.name]
                idx, valid = c
                gi = idx.expand(q.shape[0], *idx.shape)  # [Hq, Q, K]
                # K side: the softmax with the tail's logits at the window's columns, from the
                # plain one's sums: numerator and denominator minus the pages' terms plus the tail's
                st_g = s_t.gather(-1, gi)
                top = torch.maximum(shift, st_g.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True))
                e_qg = (e_q.gather(-1, gi) * torch.exp(shift - top)).masked_fill(~valid, 0.0)
                e_tg = torch.exp(st_g - top).masked_fill(~valid, 0.0)
                v_g = v_rep[:, idx]  # [Hq, Q, K, D]
                diff = e_tg - e_qg
                r = torch.exp(shift - top)
                k_out = (num * r + torch.einsum("hqk,hqkd->hqd", diff, v_g)) / (den * r + diff.sum(-1, keepdim=True))
                # V side: the exact weights, the tail's values at the window's columns
                p_g = p_exact.gather(-1, gi).masked_fill(~valid, 0.0)
                v_out = base_v + torch.einsum("hqk,hqkd->hqd", p_g, vt_rep[:, idx] - vq_rep[:, idx])
            row["k"][codec.name] = float((k_out - exact).square().mean()) / norm
            row["v"][codec.name] = float((v_out - exact).square().mean()) / norm
    return out
