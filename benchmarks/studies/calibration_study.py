"""Side-by-side study of first-chunk calibration estimators (key centre, value centre, fp8 headroom)
on the embedded SmolLM2: mean KL of the next-token distribution vs the bf16 cache, per format and
per estimator variant, all in one process with the model loaded once (1 thread).

    .venv/bin/python benchmarks/studies/calibration_study.py --windows 8 \
        --formats fp8,turbo4,turbo3,fp8k_turbo3v --variants base,current
    .venv/bin/python benchmarks/studies/calibration_study.py --text stdlib --windows 8 ...
    .venv/bin/python benchmarks/studies/calibration_study.py --windows 8 --only 0,2,5,7 ...  # a subset

A variant is a function (keys, values, queries, k_codec, v_codec) -> Calibration, patched in place
of `pagedkv.integrations.transformers.calibrate` (the cache's own hook; the cache passes each
layer's first chunk with its queries). Names: "current" = the library's calibrate (without
channel multipliers); otherwise KEY[:VALUE[:CODECS[:HEADROOM]]] with KEY one of KEY_CENTRES
("base" = the query-free fallback `calibration.key_centre`: median, fp8 a 3%-trimmed mean, the
estimator before this study; "lib" = `calibration.attention_key_centre`, first order, 64 queries;
"attn2" = second order over 16 queries, kappa measured on the chunk; "attnN" = first order over N
queries; "attnp" = weights p^2 without ||v - o||^2; "strat" = geometric query positions weighted
by their stratum; "late" = the chunk's second half of queries), VALUE one of VALUE_CENTRES applied
to the V codecs CODECS ("all" or one codec), HEADROOM the fp8 scale headroom (default 2).
Windows/KL exactly as `pagedkv eval` (pagedkv.eval.runner).

--text: "pydoc" (the eval default, pydoc_data.topics) or "stdlib" (a second English text: the
docstrings of 85 stdlib modules, concatenated in sorted module order), or a file path.

Measured (2026-11-29, KL vs bf16; pydoc = the eval's 8 windows unless marked):
    fp8, pydoc 8 windows:  base 0.00786 | attn(256 queries) 0.00583 | + V centre (fp8 V):
        mean 0.00624, median 0.00627, p^2-weighted 0.00596 | headroom 1: 0.00591
    pydoc 8 windows, base -> lib:   fp8 0.00786 -> 0.00594, turbo4 0.02625 -> 0.02317,
        turbo3 0.09936 -> 0.09947, fp8k_turbo3v 0.02511 -> 0.02290
    stdlib 8 windows, base -> lib:  fp8 0.00703 -> 0.00522, turbo4 0.02224 -> 0.02010,
        turbo3 0.09154 -> 0.08465, fp8k_turbo3v 0.02186 -> 0.02037
    pydoc windows 0,2,5,7 (fp8 / turbo4 / turbo3):  lib 0.00581 / 0.02345 / 0.10047,
        strat 0.00602 / 0.02404 / 0.09844, late 0.00594 / 0.02465 / 0.10519,
        attn2 0.00601 / 0.02326 / 0.09549
    pydoc windows 0,2,5,7 (fp8 / turbo4 / turbo3 / fp8k_turbo3v): current(before) 0.00800 /
        0.02828 / 0.10101 / 0.02582; attn 0.00601 / 0.02178 / 0.09868 / 0.02293; attnp 0.00805 /
        0.02656 / 0.10991 / 0.02565; per-channel weights for turbo (attnch) turbo4 0.02565
    query count (windows 0,2,5,7; fp8 / turbo4 / fp8k_turbo3v): 32: 0.00585 / 0.02202 / 0.02325,
        64: 0.00581 / 0.02345 / 0.02364, 256: 0.00601 / 0.02178 / 0.02293, 1024: 0.00623 /
        0.02079 / 0.02175 (within the window-to-window noise, ~+-10% per window for turbo3)
    stdlib 8 windows, current (bias-aware for turbo): turbo3 0.08911, turbo4 0.01951
    V centre ("cur" = the library's key centres; windows 0,2,5,7), none -> p^2-weighted
        (cur:attn:all): fp8 0.00572 -> 0.00596, q8_0 0.00026 -> 0.00023, q4_0 0.0523 -> 0.0513,
        turbo8 0.00271 -> 0.00245, turbo4 0.0228 -> 0.0223, turbo3 0.0978 -> 0.0960, turbo2 0.607
        -> 0.606, fp8k_turbo3v 0.0235 -> 0.0207, bf16k_turbo2v 0.1129 -> 0.0854, fp8k_turbo2v
        0.1194 -> 0.0918, turbo3+hp 0.0851 -> 0.0860 (the "none" column from `pagedkv eval`'s
        kl_per_window; its fp8 differs from a 1-thread run by ~+-5% per window: thread noise);
        median V centre (turbo4 / turbo3 / fp8k_turbo3v): 0.0252 / 0.1128 / 0.0375 (worse)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import os
import sys
import time
from typing import Callable, Dict

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pagedkv.eval.metrics import MetricSums, log_probs  # noqa: E402
from pagedkv.eval.model import embedded_model_source, load_model  # noqa: E402
from pagedkv.eval.runner import EvalConfig, _forward, parse_choice  # noqa: E402
from pagedkv.eval.text import bos_id, default_text, make_windows, read_text, tokenize  # noqa: E402
from pagedkv.codecs.catalogue import get_codec  # noqa: E402
from pagedkv.cache import calibration as cal  # noqa: E402
from pagedkv.integrations import transformers as tfi  # noqa: E402

STDLIB_MODULES = (
    "abc argparse ast asyncio base64 bisect calendar cmd codecs collections concurrent.futures "
    "configparser contextlib copy csv dataclasses datetime decimal difflib dis email enum "
    "fileinput fnmatch fractions ftplib functools gettext glob heapq hmac html http.client "
    "http.server imaplib inspect io ipaddress itertools json logging mailbox mimetypes "
    "multiprocessing numbers operator optparse os pathlib pdb pickle pprint queue random re "
    "sched secrets selectors shelve shlex shutil smtplib socket sqlite3 statistics string "
    "subprocess tarfile tempfile textwrap threading timeit tokenize trace traceback types typing "
    "unittest urllib.parse urllib.request uuid warnings weakref xml.dom.minidom zipfile"
).split()


def stdlib_text() -> str:
    """A second real English text: docstrings (module, classes, functions) of stdlib modules."""
    parts = []
    for name in sorted(STDLIB_MODULES):
        try:
            mod = importlib.import_module(name)
        except Exception:  # pragma: no cover - platform modules
            continue
        if mod.__doc__:
            parts.append(inspect.cleandoc(mod.__doc__))
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 80:
                parts.append(inspect.cleandoc(doc))
    return "\n\n".join(parts)


# -------------------------------------------------------------------------------------------------
# estimator pieces


def attention_weights(keys, values, queries, max_queries: int = 256):
    """Attention statistics of the first chunk: for evenly spaced queries (at most max_queries,
    causal, scale D^-0.5), a[b,h,g,q,j] = p_qj^2 * ||v_j - o_q||^2 (the weight of key j's logit
    error in the output error), u = p_qj^2 (the weight of value j's error), and q2 = q^2.
    keys/values [B, H, T, D]; queries [B, Hq, T, D]."""
    b, h, t, d = keys.shape
    g = queries.shape[1] // h
    n = min(t, max_queries)
    pos = torch.linspace(0, t - 1, n).round().long()
    q = queries.reshape(b, h, g, t, d)[:, :, :, pos]  # [B,H,G,N,D]
    s = torch.einsum("bhgnd,bhtd->bhgnt", q, keys) * d ** -0.5
    mask = torch.arange(t)[None, :] > pos[:, None]  # [N, T]
    s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.einsum("bhgnt,bhtd->bhgnd", p, values)
    # ||v_j - o_q||^2 = ||v_j||^2 - 2 v_j.o_q + ||o_q||^2
    vv = values.pow(2).sum(-1)  # [B,H,T]
    dist = vv[:, :, None, None, :] - 2 * torch.einsum("bhgnd,bhtd->bhgnt", o, values) + o.pow(2).sum(-1)[..., None]
    p2 = p * p
    return p2 * dist.clamp_min(0), p2, q * q


def key_centre_weighted(keys, values, queries, k_codec, per_channel=None, use_v=True, max_queries=256):
    """key_centre_attn with its choices open: per_channel None = by codec; use_v False drops
    the ||v_j - o_q||^2 factor (weights p^2 only)."""
    a, p2, q2 = attention_weights(keys, values, queries, max_queries)
    if not use_v:
        a = p2
    ch = (k_codec == "fp8") if per_channel is None else per_channel
    if ch:
        w = torch.einsum("bhgnt,bhgnd->bhtd", a, q2)
    else:
        w = torch.einsum("bhgnt,bhgn->bht", a, q2.sum(-1))[..., None]
    return (w * keys).sum(dim=(0, 2)) / w.sum(dim=(0, 2)).clamp_min(1e-30)


def key_centre_strat(keys, values, queries, k_codec, n=64):
    """First-order centre with every query of the chunk represented: n positions spaced
    geometrically (dense early, where few keys make errors large), each weighted by the number
    of positions its stratum holds (an estimate of the sum over all T queries)."""
    b, h, t, d = keys.shape
    g = queries.shape[1] // h
    pos = torch.unique(torch.cat([torch.zeros(1), torch.logspace(0, torch.log10(torch.tensor(t - 1.0)), n)]).round().long())
    edges = torch.cat([torch.zeros(1), (pos[1:] + pos[:-1]).float() / 2, torch.tensor([t - 0.5])])
    width = (edges[1:] - edges[:-1])  # [n]
    q = queries.reshape(b, h, g, t, d)[:, :, :, pos]
    sc = torch.einsum("bhgnd,bhtd->bhgnt", q, keys) * d ** -0.5
    sc = sc.masked_fill(torch.arange(t)[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(sc, -1)
    o = torch.einsum("bhgnt,bhtd->bhgnd", p, values)
    dist = (values[:, :, None, None] - o[..., None, :]).pow(2).sum(-1)
    a = p * p * dist * width[:, None]
    q2 = q * q
    if k_codec == "fp8":
        w = torch.einsum("bhgnt,bhgnd->bhtd", a, q2)
    else:
        w = torch.einsum("bhgnt,bhgn->bht", a, q2.sum(-1))[..., None]
    return (w * keys).sum(dim=(0, 2)) / w.sum(dim=(0, 2)).clamp_min(1e-30)


def key_centre_attn(keys, values, queries, k_codec):
    """Key centre minimising the expected output error of the first chunk's attention under a
    logit error delta_j with E[delta_j^2] ~ sum_i w_i (k_ji - c_i)^2: per channel (fp8: relative
    error per element, w_i = q_i^2) or isotropic (rotated codecs, w = ||q||^2)."""
    a, _, q2 = attention_weights(keys, values, queries)
    if k_codec == "fp8":
        w = torch.einsum("bhgnt,bhgnd->bhtd", a, q2)  # [B,H,T,D]
    else:
        w = torch.einsum("bhgnt,bhgn->bht", a, q2.sum(-1))[..., None]
    return (w * keys).sum(dim=(0, 2)) / w.sum(dim=(0, 2)).clamp_min(1e-30)


def key_centre_second_order(keys, values, queries, k_codec, max_queries=16):
    """Rotated codecs, second order in the logit error: with delta_j ~ N(0, s_q ||k_j - c||^2),
    s_q = kappa ||q||^2 / D^2 (kappa: the codec's relative squared error, measured by a
    roundtrip of the first-order-centred chunk), E||do||^2 ~ sum_j p_j^2 s ||k_j - c||^2
    ||v_j - o||^2 + 1/4 ||sum_j p_j s ||k_j - c||^2 (v_j - o)||^2; the second (bias: noisier
    keys gain weight, E e^delta = e^(sigma^2/2)) is ||r_q - 2 M_q c||^2 s^2 / 4 with
    r_q = sum_j p_j ||k_j||^2 (v_j - o), M_q = sum_j p_j (v_j - o) k_j^T (sum_j p_j (v_j - o) = 0
    kills the ||c||^2 term): quadratic in c, solved per head."""
    from pagedkv.codecs.catalogue import get_codec
    from pagedkv.codecs.reference import roundtrip

    if k_codec == "fp8":
        return key_centre_attn(keys, values, queries, k_codec)
    c1 = cal.attention_key_centre(keys, values, queries, k_codec)
    kc = keys - c1[None, :, None, :]
    err = roundtrip(get_codec(k_codec), kc) - kc
    kappa = float(err.pow(2).sum() / kc.pow(2).sum())
    b, h, t, d = keys.shape
    g = queries.shape[1] // h
    n = min(t, max_queries)
    pos = torch.linspace(0, t - 1, n).round().long()
    q = queries.reshape(b, h, g, t, d)[:, :, :, pos]
    sc = torch.einsum("bhgnd,bhtd->bhgnt", q, keys) * d ** -0.5
    sc = sc.masked_fill(torch.arange(t)[None, :] > pos[:, None], float("-inf"))
    p = torch.softmax(sc, dim=-1)
    o = torch.einsum("bhgnt,bhtd->bhgnd", p, values)
    dv = values[:, :, None, None] - o[..., None, :]  # [B,H,G,n,T,D]
    A = p * p * dv.pow(2).sum(-1)
    sq = kappa * q.pow(2).sum(-1) / d ** 2  # [B,H,G,n]
    W = torch.einsum("bhgn,bhgnt->h", sq, A)
    m = torch.einsum("bhgn,bhgnt,bhtd->hd", sq, A, keys)
    pk = p * keys.pow(2).sum(-1)[:, :, None, None]  # p_j ||k_j||^2
    r = torch.einsum("bhgnt,bhgntd->bhgnd", pk, dv)
    M = torch.einsum("bhgnt,bhgnte,bhtd->bhgned", p, dv, keys)  # [.., Dv, Dk]
    s2 = sq * sq
    G = torch.einsum("bhgn,bhgned,bhgnef->hdf", s2, M, M)
    rhs = m + 0.5 * torch.einsum("bhgn,bhgned,bhgne->hd", s2, M, r)
    lhs = G + W[:, None, None] * torch.eye(d)
    return torch.linalg.solve(lhs.double(), rhs.double()[..., None])[..., 0].float()


def value_centre_attn(keys, values, queries):
    """Value centre minimising sum_j E[p_j^2] ||v_j - c||^2: the p^2-weighted mean value."""
    _, u, _ = attention_weights(keys, values, queries)
    w = u.sum(dim=(2, 3))[..., None]  # [B,H,T,1]
    return (w * values).sum(dim=(0, 2)) / w.sum(dim=(0, 2)).clamp_min(1e-30)


def trimmed_mean(keys, frac):
    med = keys.median(dim=2).values.mean(dim=0)
    t = keys.shape[2]
    dist = (keys - med[None, :, None, :]).norm(dim=-1)
    keep = max(1, t - int(frac * t) - 1)
    idx = dist.argsort(dim=2, stable=True)[..., :keep]
    sel = torch.gather(keys, 2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
    return sel.mean(dim=(0, 2))


KEY_CENTRES: Dict[str, Callable] = {
    "base": lambda k, v, q, c: cal.key_centre(k, c),
    "median": lambda k, v, q, c: k.median(dim=2).values.mean(dim=0),
    "mean": lambda k, v, q, c: k.mean(dim=(0, 2)),
    "trim3": lambda k, v, q, c: trimmed_mean(k, 0.03),
    "attn": key_centre_attn,
    "attnp": lambda k, v, q, c: key_centre_weighted(k, v, q, c, use_v=False),
    "attnch": lambda k, v, q, c: key_centre_weighted(k, v, q, c, per_channel=True),
    "attniso": lambda k, v, q, c: key_centre_weighted(k, v, q, c, per_channel=False),
    "attn64": lambda k, v, q, c: key_centre_weighted(k, v, q, c, max_queries=64),
    "attn1k": lambda k, v, q, c: key_centre_weighted(k, v, q, c, max_queries=1024),
    "attn32": lambda k, v, q, c: key_centre_weighted(k, v, q, c, max_queries=32),
    "attn16": lambda k, v, q, c: key_centre_weighted(k, v, q, c, max_queries=16),
    "lib": lambda k, v, q, c: cal.attention_key_centre(k, v, q, c),
    "cur": lambda k, v, q, c: (cal.bias_aware_key_centre(k, v, q, c) if c != "fp8" and get_codec(c).rotated
                               else cal.attention_key_centre(k, v, q, c)),
    "attn2": key_centre_second_order,
    "strat": key_centre_strat,
    "strat16": lambda k, v, q, c: key_centre_strat(k, v, q, c, n=16),
    "late": lambda k, v, q, c: cal.attention_key_centre(k, v, q[:, :, q.shape[2] // 2:], c),
}
VALUE_CENTRES: Dict[str, Callable] = {
    "none": lambda k, v, q: None,
    "mean": lambda k, v, q: v.mean(dim=(0, 2)),
    "median": lambda k, v, q: v.median(dim=2).values.mean(dim=0),
    "attn": value_centre_attn,
}


def make_variant(kc: str, vc: str, vc_codecs: str, headroom: float):
    """kc: key centre name; vc: value centre name, applied to V codecs in vc_codecs ("fp8",
    "all"); headroom: fp8 tensor scale headroom."""

    def calibrate(keys, values, queries, k_codec, v_codec, options, device):
        k32, v32 = keys.detach().float(), values.detach().float()
        q32 = queries.detach().float() if queries is not None else None
        centre = KEY_CENTRES[kc](k32, v32, q32, k_codec) if options.key_centring else None
        kcn = k32 - centre[None, :, None, :] if centre is not None else k32
        v_centre = None
        if v_codec != "bf16" and (vc_codecs == "all" or v_codec == vc_codecs):
            v_centre = VALUE_CENTRES[vc](k32, v32, q32)
        vcn = v32 - v_centre[None, :, None, :] if v_centre is not None else v32
        old = cal.FP8_HEADROOM
        cal.FP8_HEADROOM = headroom
        try:
            ks = cal.fp8_tensor_scale(kcn, device) if k_codec == "fp8" else None
            vs = cal.fp8_tensor_scale(vcn, device) if v_codec == "fp8" else None
        finally:
            cal.FP8_HEADROOM = old
        return cal.Calibration(k_centre=None if centre is None else centre.contiguous(),
                               v_centre=None if v_centre is None else v_centre.contiguous(),
                               k_scale=ks, v_scale=vs)

    return calibrate


def parse_variant(spec: str):
    """"current" (the library's calibrate) or kc[:vc[:codecs[:headroom]]], e.g. attn:attn:fp8:2:
    key centre, value centre, the V codecs it applies to ("all" or one codec name), fp8 headroom."""
    if spec == "current":  # the library's calibrate, without channel multipliers
        return lambda k, v, q, kc, vc, options, device: cal.calibrate(
            k, v, q, kc, vc, dataclasses.replace(options, key_scaling=False), device)
    parts = spec.split(":")
    kc = parts[0]
    vc = parts[1] if len(parts) > 1 else "none"
    codecs = parts[2] if len(parts) > 2 else "all"
    hr = float(parts[3]) if len(parts) > 3 else cal.FP8_HEADROOM
    if kc not in KEY_CENTRES or vc not in VALUE_CENTRES:
        raise SystemExit(f"unknown variant {spec!r}: key centres {list(KEY_CENTRES)}, value centres {list(VALUE_CENTRES)}")
    return make_variant(kc, vc, codecs, hr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="fp8,turbo4,turbo3,fp8k_turbo3v")
    ap.add_argument("--variants", default="current,attn")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of window indices to keep (of --windows)")
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--text", default="pydoc")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lm = load_model(embedded_model_source(), attn_implementation="pagedkv")
    text = {"pydoc": default_text, "stdlib": stdlib_text}.get(args.text, lambda: read_text(args.text))()
    tokens = tokenize(lm.tokenizer, text)
    windows = make_windows(tokens, args.windows, args.window_tokens, bos_id(lm.tokenizer))
    if args.only:
        windows = [windows[int(i)] for i in args.only.split(",")]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    cfg = EvalConfig(windows=len(windows), window_tokens=args.window_tokens)
    print(f"# {args.text}: {tokens.numel()} tokens, {len(windows)} windows x {args.window_tokens}", flush=True)
    sums = {(v, f): MetricSums() for v in variants for f in formats}
    t0 = time.perf_counter()
    for wi, w in enumerate(windows):
        ids = w[None]
        ref = log_probs(_forward(lm.model, ids, parse_choice("bf16"), cfg)[0][0, :-1])
        for v in variants:
            fn = parse_variant(v)
            orig = tfi.calibrate
            tfi.calibrate = fn
            try:
                for f in formats:
                    logits, _ = _forward(lm.model, ids, parse_choice(f), cfg)
                    sums[(v, f)].add(logits[0, :-1], w[1:], ref)
            finally:
                tfi.calibrate = orig
        print(f"# window {wi} done ({time.perf_counter() - t0:.0f}s): "
              + " ".join(f"{v}/{f}={sums[(v, f)].per_window_kl[-1]:.5f}" for v in variants for f in formats),
              file=sys.stderr, flush=True)
    print("| variant | " + " | ".join(formats) + " |")
    print("|---|" + "---|" * len(formats))
    for v in variants:
        print(f"| {v} | " + " | ".join(f"{sums[(v, f)].mean_kl:.5f}" for f in formats) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
