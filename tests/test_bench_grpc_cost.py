"""bench.grpc_cost runs both ways end to end: a real server process, every request's messages
received (per call, or demultiplexed from the one stream), CPU read for both processes."""

from __future__ import annotations

import math

import pytest

from bench.grpc_cost import Load, run

pytestmark = pytest.mark.integration  # a real gRPC server process


def test_both_ways_deliver_every_message_and_report_cpu_per_request() -> None:
    figures = run(Load(messages=3, concurrency=4, rounds=2, step_ms=0.0))
    assert set(figures) == {"calls", "mux"}
    for way in figures.values():
        assert set(way) == {"server ms", "client ms"}
        assert all(math.isfinite(value) and value >= 0 for value in way.values())
        assert way["client ms"] > 0  # the client's own process time always moves
