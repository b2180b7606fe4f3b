"""Scenario 2's sequential overhead is the median of paired differences, not a difference of medians."""

from __future__ import annotations

import math

from bench.client import LoadResult, RequestTiming
from bench.s2_overhead import paired_overhead_ms


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
