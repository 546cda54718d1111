"""Lloyd-Max scalar quantizers: the exact N(0,1) solver and a fit to sampled distributions.

`gaussian_levels(bits)` solves the MSE-optimal quantizer of N(0,1) by Lloyd's fixed point
(thresholds at midpoints, levels at the conditional means) with exact Gaussian integrals; its
MSE matches Max (1960): 0.3634, 0.1175, 0.03454, 0.009497 for 1-4 bits.

`fit_levels(samples, levels)` runs the same fixed point on samples: the turbo codecs fit their
levels to the distribution the codebook actually sees (values divided by their group scale).
"""

from __future__ import annotations

import math

import torch


def _pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def gaussian_levels(bits: int, iters: int = 2000, tol: float = 1e-12) -> list[float]:
    """Ascending levels of the Lloyd-Max quantizer of N(0,1) with 2**bits levels."""
    n = 2**bits
    levels = [(-(n - 1) + 2 * i) / n * 2.0 for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        new = []
        for lo, hi in zip(edges, edges[1:]):
            p = _cdf(hi) - _cdf(lo)
            new.append((_pdf(lo) - _pdf(hi)) / p)
        shift = max(abs(a - b) for a, b in zip(new, levels))
        levels = new
        if shift < tol:
            break
    return levels


def gaussian_mse(levels: list[float]) -> float:
    """MSE of quantizing N(0,1) to the nearest of `levels` (exact integral)."""
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    total = 0.0
    for c, lo, hi in zip(levels, edges, edges[1:]):
        # E[(X - c)^2 ; lo < X < hi] = [m2] - 2c[m1] + c^2 [m0]
        m0 = _cdf(hi) - _cdf(lo)
        m1 = _pdf(lo) - _pdf(hi)
        lo_t = 0.0 if math.isinf(lo) else lo * _pdf(lo)
        hi_t = 0.0 if math.isinf(hi) else hi * _pdf(hi)
        m2 = m0 + lo_t - hi_t
        total += m2 - 2 * c * m1 + c * c * m0
    return total


def fit_levels(samples: torch.Tensor, levels: torch.Tensor, iters: int = 50) -> torch.Tensor:
    """Lloyd's fixed point on 1-D `samples` from initial ascending `levels` (float64 math)."""
    x = samples.double().flatten()
    lv = levels.double().clone()
    for _ in range(iters):
        mids = (lv[1:] + lv[:-1]) / 2
        idx = torch.bucketize(x, mids)
        sums = torch.zeros_like(lv).index_add_(0, idx, x)
        counts = torch.zeros_like(lv).index_add_(0, idx, torch.ones_like(x))
        lv = torch.where(counts > 0, sums / counts.clamp_min(1), lv)
    return lv.sort().values
