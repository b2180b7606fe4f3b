"""Scenario 2's sequential overhead is the median of paired differences, not a difference of medians."""

from __future__ import annotations

import math

from bench.client import LoadResult, RequestTiming
from bench.s2_overhead import paired_differences_ms, paired_overhead_ms
from bench.stats import median_interval


def _load(latencies: list[float], errors: frozenset[int] = frozenset(), ttft: float = 0.01) -> LoadResult:
    timings = [
        RequestTiming(math.nan if i in errors else ttft, latency, 16, "HTTP 500" if i in errors else None)
        for i, latency in enumerate(latencies)
    ]
    return LoadResult(sum(latencies), timings)


def test_pairs_take_drift_out_and_skip_failed_pairs() -> None:
    # The machine slows down over the run: both systems drift alike, ours is 2 ms slower per pair.
    direct = [0.100 + 0.010 * i for i in range(9)]
    ours = [latency + 0.002 for latency in direct]
    ours[4] = 9.0  # that pair failed on the direct side: left out, not counted as 8.9 s
    assert math.isclose(paired_overhead_ms(_load(ours), _load(direct, errors=frozenset({4}))), 2.0, abs_tol=1e-9)


def test_a_missing_first_token_leaves_that_pair_out_of_the_ttft_overhead() -> None:
    ours, direct = _load([0.2, 0.2], ttft=0.013), _load([0.2, 0.2], ttft=0.010)
    ours.timings[0] = RequestTiming(math.nan, 0.2, 0)
    assert math.isclose(paired_overhead_ms(ours, direct, "ttft_s"), 3.0, abs_tol=1e-9)
    assert math.isnan(paired_overhead_ms(_load([0.2], errors=frozenset({0})), _load([0.2])))


def test_the_median_interval_is_the_order_statistics_of_the_binomial_table() -> None:
    # Published 95% ranks for the median: n=16 -> 4th..13th, n=24 -> 7th..18th, n=32 -> 10th..23rd.
    for n, (low, high) in {16: (4, 13), 24: (7, 18), 32: (10, 23), 6: (1, 6)}.items():
        values = [float(rank) for rank in range(n, 0, -1)]  # unsorted on purpose
        assert median_interval(values) == (low, high)
    assert all(math.isnan(bound) for bound in median_interval([1.0, 2.0, 3.0, 4.0, 5.0]))


def test_paired_differences_are_in_ms_and_skip_failed_pairs() -> None:
    ours, direct = _load([0.105, 0.3, 0.2]), _load([0.1, 0.1, 0.2], errors=frozenset({1}))
    assert [round(d, 9) for d in paired_differences_ms(ours, direct)] == [5.0, 0.0]
