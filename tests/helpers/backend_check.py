"""Check any ops backend against the reference: the helper the CPU and Triton tests reuse.

    from helpers.backend_check import check_backend, default_cases
    report = check_backend(decode_attention=cpu.decode_attention, prefill_attention=...,
                           store=cpu.store, cases=default_cases(pairs=...))

Each callable has the reference signature (`pagedkv.ops.reference`) and gets validated inputs.
For every case the store is compared byte for byte with the reference store (or, with
`store_exact=False`, by decoded values), then decode and prefill outputs are compared with the
reference outputs on the same pools: |out - ref| <= atol * rms(v) + rtol * |ref|, plus, with a
sparse-V threshold t, out - ref must lie (within the same tolerance) in the interval that
dropping any subset of the reference's dropped positions reaches:
[sum_{p_j < t} min(0, p_j v_j), sum_{p_j < t} max(0, p_j v_j)] (see docs/internals.md "Sparse V").
Returns a list of per-case dicts with the measured max errors; raises AssertionError naming the
first failing case.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Optional

import torch

from pagedkv.codecs import reference as codec_ref
from pagedkv.codecs.catalogue import CODECS, Codec, ScaleType
from pagedkv.codecs.layout import block_views
from pagedkv.formats import all_formats
from pagedkv.ops import AttentionParams, reference
from pagedkv.ops.batch import PagedLayer

from .attention_oracle import Case, make_case, run_op, sparse_interval


@dataclass(frozen=True)
class CheckCase:
    """One scenario: a codec pair, a shape, a ragged batch, attention settings."""

    k_codec: str
    v_codec: str
    seq_lens: tuple = (37, 1, 64)
    q_lens: Optional[tuple] = None
    num_kv_heads: int = 2
    group: int = 3
    head_dim: int = 64
    block_size: int = 16
    centre: bool = False
    k_offset: float = 0.0
    sliding_window: Optional[int] = None
    soft_cap: Optional[float] = None
    sinks: bool = False
    sparse_v_threshold: float = 0.0
    transform: bool = False
    seed: int = 0

    @property
    def label(self) -> str:
        extras = [f"{k}={v}" for k, v in (("window", self.sliding_window), ("cap", self.soft_cap),
                                          ("sparse", self.sparse_v_threshold or None))
                  if v is not None]
        extras += ["sinks"] * self.sinks + ["centre"] * self.centre + ["transform"] * self.transform
        return (f"k={self.k_codec} v={self.v_codec} H={self.num_kv_heads}x{self.group} D={self.head_dim} "
                f"bs={self.block_size} lens={list(self.seq_lens)} {' '.join(extras)}").strip()

    def params(self) -> AttentionParams:
        hq = self.num_kv_heads * self.group
        sinks = torch.linspace(-1.0, 2.0, hq) if self.sinks else None
        return AttentionParams(scale=self.head_dim ** -0.5, sliding_window=self.sliding_window,
                               soft_cap=self.soft_cap, sinks=sinks,
                               sparse_v_threshold=self.sparse_v_threshold)

    def build(self, store_backend=None, device="cpu") -> Case:
        return make_case(CODECS[self.k_codec], CODECS[self.v_codec], seq_lens=self.seq_lens,
                         q_lens=self.q_lens, num_kv_heads=self.num_kv_heads, group=self.group,
                         head_dim=self.head_dim, block_size=self.block_size, centre=self.centre,
                         k_offset=self.k_offset, seed=self.seed, store_backend=store_backend,
                         transform=self.transform, device=device)


def all_pairs(support=None, *, store: bool = False) -> list:
    """Every (K codec, V codec) name pair of the catalogue, from the format registry; with a
    `CodecSupport` only the pairs whose both codecs it implements (attention, or the store with
    store=True): a backend's tests loop over what it declares, and `refused_codecs` gives the
    rows the dispatcher must hand to the reference instead."""
    ok = set(CODECS) - set(refused_codecs(support, store=store))
    return [(f.k.name, f.v.name) for f in all_formats() if f.k.name in ok and f.v.name in ok]


def refused_codecs(support=None, *, store: bool = False) -> list:
    """Names of the catalogue rows `support` (a CodecSupport, None = all) does not implement."""
    if support is None:
        return []
    return [n for n, c in CODECS.items() if support.refusal(c, store=store) is not None]


def default_cases(pairs: Optional[Iterable] = None) -> list:
    """A compact grid: every pair on a tiny ragged batch (every other pair with the per-layer
    transform k_mult / k_centre / v_centre, so each codec meets it on both sides), then settings
    on a few pairs (the transform with sinks, soft-cap, sparse V and prefill among them)."""
    pairs = all_pairs() if pairs is None else list(pairs)
    cases = [CheckCase(k, v, seq_lens=(19, 1, 33), num_kv_heads=1, group=2, transform=bool(i % 2))
             for i, (k, v) in enumerate(pairs)]
    few = [("turbo3", "turbo3"), ("fp8", "turbo2"), ("bf16", "turbo4"), ("turbo4", "q8_0")]
    for (k, v), extra in zip(itertools.cycle(few), [
        dict(group=1, head_dim=128, block_size=32),
        dict(group=8, num_kv_heads=1, head_dim=64, sliding_window=20),
        dict(group=3, head_dim=256, soft_cap=30.0, sinks=True),
        dict(group=3, sparse_v_threshold=1e-2),
        dict(centre=True, k_offset=4.0, seq_lens=(70, 5)),
        dict(q_lens=(37, 1, 20), sliding_window=9, soft_cap=20.0),
        dict(group=3, sinks=True, soft_cap=20.0, transform=True, seq_lens=(40, 0, 9)),
        dict(group=3, sparse_v_threshold=1e-2, transform=True),
        dict(q_lens=(30, 1, 12), sinks=True, transform=True, head_dim=128),
        dict(group=4, num_kv_heads=2, transform=True, sliding_window=12, seq_lens=(50, 3)),
    ]):
        cases.append(CheckCase(k, v, **extra))
    return cases


def _pool_rows(layer: PagedLayer, codec: Codec, pool: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    data, scales = block_views(codec, pool, layer.block_size, layer.num_kv_heads, layer.head_dim)
    ts = float(scale) if codec.scale_type is ScaleType.TENSOR_FP32 else None
    return codec_ref.decode(codec, data, scales, layer.head_dim, ts)


def compare_store(case: Case, ref_case: Case, exact: bool, atol: float) -> float:
    """Max difference between two stores of the same rows (bytes when exact, else decoded values)."""
    worst = 0.0
    for side in ("k", "v"):
        got, want = getattr(case.layer, f"{side}_pool"), getattr(ref_case.layer, f"{side}_pool")
        if exact:
            diff = int((got.cpu() != want.cpu()).sum())
            assert diff == 0, f"{side} pool differs from the reference store in {diff} bytes"
        else:
            codec = getattr(case.layer, f"{side}_codec")
            scale = getattr(case.layer, f"{side}_scale")
            d = (_pool_rows(case.layer, codec, got.cpu(), scale) - _pool_rows(case.layer, codec, want.cpu(), scale)).abs().max()
            worst = max(worst, float(d))
            assert worst <= atol, f"{side} pool decodes to values {worst} away from the reference store"
    return worst


def check_backend(*, decode_attention: Optional[Callable] = None, prefill_attention: Optional[Callable] = None,
                  store: Optional[Callable] = None, cases: Optional[Iterable[CheckCase]] = None,
                  atol: float = 2e-4, rtol: float = 2e-4, store_exact: bool = True,
                  store_atol: float = 0.0, device: torch.device | str = "cpu") -> list:
    """Compare a backend's ops with the reference on `cases` (default: `default_cases()`).

    atol is relative to rms(v) of the case (1.0 for the generated data); a backend that
    quantizes q (int8 dot products) passes a looser atol. Returns per-case measurements.
    """
    results = []
    for cc in (default_cases() if cases is None else cases):
        ref_case = cc.build(device=device)
        case = ref_case
        row = {"case": cc.label}
        if store is not None:
            case = cc.build(store_backend=_as_backend(store), device=device)
            row["store_max_diff"] = compare_store(case, ref_case, store_exact, store_atol)
        params = cc.params()
        if params.sinks is not None:
            params = replace(params, sinks=params.sinks.to(device))
        for mode, fn in (("decode", decode_attention), ("prefill", prefill_attention)):
            if fn is None:
                continue
            want = run_op(ref_case, params, mode=mode, fn=_ref(mode)).double().cpu()
            got = run_op(case, params, mode=mode, fn=fn).double().cpu()
            assert got.shape == want.shape, f"{cc.label} {mode}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            diff = got - want
            err = diff.abs()
            tol = atol + rtol * want.abs()
            if cc.sparse_v_threshold:  # distance outside the interval a subset of drops can reach
                lo, hi = sparse_interval(ref_case, params, mode=mode)
                err = (lo - diff).clamp(min=0) + (diff - hi).clamp(min=0)
            bound = tol
            row[f"{mode}_max_err"] = float(err.max()) if err.numel() else 0.0
            row[f"{mode}_max_diff"] = float(diff.abs().max()) if diff.numel() else 0.0
            assert bool(torch.isfinite(got).all()), f"{cc.label} {mode}: non-finite output"
            assert bool((err <= bound).all()), (
                f"{cc.label} {mode}: max |out - reference| = {float(err.max()):.3g} "
                f"{'outside the sparse-V interval ' if cc.sparse_v_threshold else ''}exceeds "
                f"atol {atol} + rtol {rtol} * |ref|"
            )
        results.append(row)
    return results


def _ref(mode: str) -> Callable:
    return reference.decode_attention if mode == "decode" else reference.prefill_attention


def _as_backend(store_fn: Callable):
    from pagedkv.ops.dispatch import Backend

    return Backend(name="under-test", device_types=(), store=store_fn,
                   decode_attention=reference.decode_attention,
                   prefill_attention=reference.prefill_attention)

