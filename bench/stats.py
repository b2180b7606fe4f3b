"""Percentiles and summaries of timings (seconds in, seconds out)."""

from __future__ import annotations

import math
import statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics x_(k) and
    x_(n+1-k), k the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. It assumes
    only independent samples, so it suits latencies, whose spread is far from normal. (NaN, NaN)
    when there are too few values for any such interval (fewer than 6 at 95%)."""
    ordered = sorted(values)
    n = len(ordered)
    tail, below, k = (1 - confidence) / 2, 0.0, 0
    while k < n and below + math.comb(n, k) / 2**n <= tail:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return float("nan"), float("nan")
    return ordered[k - 1], ordered[n - k]
