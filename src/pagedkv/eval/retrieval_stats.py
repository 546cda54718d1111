"""Accuracy, its 95% interval and the paired test of the retrieval tasks (torch-free, no scipy).

- Wilson score interval (Wilson, 1927): unlike the normal approximation it stays inside [0, 1]
  and is sensible at 0 or n successes, which small trial counts produce.
- McNemar's exact test for paired trials: of the trials where the format and bf16 disagree,
  b = bf16 right and the format wrong (lost), c = the reverse (gained); under "no difference"
  b ~ Binomial(b + c, 1/2); the two-sided p is min(1, 2 P(X <= min(b, c))) (1 when b + c = 0).
"""

from __future__ import annotations

import math
from typing import Sequence

Z95 = 1.959963984540054
INFORMATIVE = 0.8  # a cell whose bf16 accuracy is below this cannot judge a cache


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of correct / n (z = 1.96: 95%); (0, 1) for n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if correct == 0 else max(0.0, centre - half)
    return lo, 1.0 if correct == n else min(1.0, centre + half)


def mcnemar_exact(lost: int, gained: int) -> float:
    """Two-sided exact McNemar p for `lost` (b) and `gained` (c) discordant pairs."""
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_counts(reference: Sequence[bool], other: Sequence[bool]) -> tuple[int, int]:
    """(lost, gained): trials the reference got right and `other` wrong, and the reverse."""
    assert len(reference) == len(other), (len(reference), len(other))
    lost = sum(1 for r, o in zip(reference, other) if r and not o)
    gained = sum(1 for r, o in zip(reference, other) if o and not r)
    return lost, gained


def depth_bins(depths: Sequence[float], correct: Sequence[bool], bins: int = 5) -> list[dict]:
    """Accuracy by needle depth in `bins` equal bins of [0, 1] (the last includes 1)."""
    out = []
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [c for d, c in zip(depths, correct) if lo <= d < hi or (b == bins - 1 and d == 1.0)]
        out.append({"depth_lo": lo, "depth_hi": hi, "trials": len(inside), "correct": sum(inside)})
    return out
