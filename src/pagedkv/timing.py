"""Timing for benchmarks: the median of repeated calls (the machines are shared and noisy)."""

from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall seconds of `repeats` timed calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
