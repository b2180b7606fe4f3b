"""The encoder's counters and Prometheus metrics (served on ENCODER_METRICS_PORT).

Each count is kept once, in an EncoderCounters: GetStats reads its core's, and /metrics reads the
sum over every core of the process (one in a deployed encoder; tests run several side by side).
Prometheus counters of their own would be a second copy, incremented next to each of these.
Distributions and the queue depth exist only as Prometheus metrics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client import REGISTRY, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


def _counter(name: str, documentation: str) -> Any:
    """A count starting at 0, exported as the Prometheus counter `<name>_total`."""
    return field(default=0, metadata={"prometheus": (name, documentation)})


@dataclass
class EncoderCounters:
    """Counts since the encoder core started (GetStats); exported from here, see the module docstring."""

    # Videos count here too (the name is the GetStats field's).
    images_encoded: int = _counter("encoder_images_encoded", "Images run through the vision tower.")
    cache_hits: int = _counter("encoder_cache_hits", "Encode calls answered from Redis without encoding.")
    coalesced: int = _counter("encoder_coalesced", "Encode calls that joined an identical call in flight.")

    def __post_init__(self) -> None:
        _COUNTERS.track(self)


class _CountersCollector(Collector):
    """`<name>_total` per counter: the sum over every EncoderCounters this process made. They are
    kept for the life of the process (a few ints each), so a total never goes down."""

    def __init__(self) -> None:
        self._tracked: list[EncoderCounters] = []
        self._lock = threading.Lock()
        self._created = time.time()

    def track(self, counters: EncoderCounters) -> None:
        with self._lock:
            self._tracked.append(counters)

    def collect(self) -> Iterator[CounterMetricFamily]:
        with self._lock:
            tracked = list(self._tracked)
        for counter in fields(EncoderCounters):
            name, documentation = counter.metadata["prometheus"]
            total = sum(getattr(counters, counter.name) for counters in tracked)
            yield CounterMetricFamily(name, documentation, value=total, created=self._created)

    def describe(self) -> Iterator[CounterMetricFamily]:
        for counter in fields(EncoderCounters):
            yield CounterMetricFamily(*counter.metadata["prometheus"])


_COUNTERS = _CountersCollector()
REGISTRY.register(_COUNTERS)

ENCODE_SECONDS = Histogram(
    "encoder_encode_seconds", "Time to encode and store one image (cache misses only).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40),
)  # fmt: skip
BLOB_BYTES = Histogram(
    "encoder_blob_bytes", "Size of stored embedding blobs.", buckets=(1e4, 1e5, 5e5, 1e6, 4e6, 1.6e7, 6.4e7)
)  # fmt: skip
QUEUE_DEPTH = Gauge("encoder_batch_queue_depth", "Images waiting for a vision-tower forward pass.")
# The tower alone (pixels in, embeddings out), one observation per batch: what to compare with
# another engine's vision tower, and the service's main cost, apart from decode, resize and Redis.
FORWARD_SECONDS = Histogram(
    "encoder_forward_seconds", "Time of one vision-tower forward pass (one batch of images or videos).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80),
)  # fmt: skip
BATCH_SIZE = Histogram("encoder_batch_size", "Images per vision-tower forward pass.", buckets=(1, 2, 4, 8, 16, 32))
