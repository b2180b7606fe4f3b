"""The encoder service as deployed: its own process (`python -m encoder_service`), JPEG bytes in
over gRPC, blobs out to Redis, concurrent calls sharing forward passes through its batcher.

Each concurrency level gets images no other level saw, so every call encodes (none is a cache
hit), and keeps that many calls in flight until its images are done. The service's own counters
(GetStats) give the forward passes it ran, hence the mean batch; its `encoder_forward_seconds`
(/metrics) gives the tower's time per pass and the share of the wall the tower was busy: near 1, the
tower limits the service; well under 1, what surrounds it does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.outcome import MemoryRecord
from bench.procs import ServiceGroup, grpc_serving, python_module, wait_until
from bench.stages import histogram_totals
from bench.stats import percentile
from scripts.redis_process import free_port
from shared.sdk import AsyncEncoderClient

FORWARD_METRIC = "encoder_forward_seconds"
READY_TIMEOUT_S = 300  # loading and warming the tower; a GPU host takes seconds, 2 CPU cores a minute


@dataclass(frozen=True)
class ServiceSetup:
    checkpoint: Path
    device: str  # torch device of the tower: cuda, cpu
    dtype: str  # float32 | bfloat16 | float16
    redis_url: str
    max_batch_size: int  # most images in one forward pass (ENCODER_MAX_BATCH_SIZE)
    log_dir: Path

    def env(self, port: int, metrics_port: int, warmup_pixels: int) -> dict[str, str]:
        return {
            "ENCODER_CHECKPOINT": str(self.checkpoint),
            "ENCODER_DEVICE": self.device,
            "ENCODER_DTYPE": self.dtype,
            "ENCODER_REDIS_URL": self.redis_url,
            "ENCODER_PORT": str(port),
            "ENCODER_HOST": "127.0.0.1",
            "ENCODER_METRICS_PORT": str(metrics_port),
            "ENCODER_MAX_BATCH_SIZE": str(self.max_batch_size),
            "ENCODER_LOG_LEVEL": "WARNING",
            "ENCODER_WARMUP_PIXELS": str(warmup_pixels),  # the workload's size: its first pass, before serving
        }


async def _level(target: str, metrics_url: str, images: list[bytes], concurrency: int) -> dict[str, Any]:
    """All `images` through Encode with `concurrency` calls in flight; one row of the table."""
    latencies: list[float] = []
    async with AsyncEncoderClient(target, timeout_s=READY_TIMEOUT_S) as client:
        before = await client.stats()
        tower_s_before, _ = histogram_totals(metrics_url, FORWARD_METRIC)
        pending = iter(images)  # shared: each caller takes the next image when its call returns

        async def caller() -> None:
            for image in pending:
                started = time.perf_counter()
                reply = await client.encode(image_bytes=image)
                latencies.append(time.perf_counter() - started)
                if reply.cache_hit:
                    raise RuntimeError("an image was a cache hit: the images of a run must be distinct")

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        after = await client.stats()
        tower_s = histogram_totals(metrics_url, FORWARD_METRIC)[0] - tower_s_before
    passes = after.forward_passes - before.forward_passes
    encoded = after.media_encoded - before.media_encoded
    return {
        "images": encoded,
        "calls": passes,
        "mean batch": encoded / passes if passes else float("nan"),
        "wall s": elapsed,
        "p50 latency ms": percentile(latencies, 50) * 1000,
        "p90 latency ms": percentile(latencies, 90) * 1000,
        "tower ms per pass": tower_s / passes * 1000 if passes else float("nan"),
        "tower busy": tower_s / elapsed,
    }


def run_service(
    setup: ServiceSetup, levels: dict[int, list[bytes]], warm_up: list[bytes], warmup_pixels: int
) -> tuple[dict[int, dict[str, Any]], list[MemoryRecord]]:
    """Starts the service, sends `warm_up` all at once (untimed: the first passes of a batch shape
    pay for kernel selection), then each level's images at its concurrency, in order; stops it."""
    port, metrics_port = free_port(), free_port()
    target, metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    rows: dict[int, dict[str, Any]] = {}
    with ServiceGroup(setup.log_dir) as group:
        encoder = group.start("encoder", python_module("encoder_service"), setup.env(port, metrics_port, warmup_pixels))
        wait_until(encoder, grpc_serving(target), READY_TIMEOUT_S)
        asyncio.run(_level(target, metrics_url, warm_up, len(warm_up)))
        for concurrency, images in levels.items():
            rows[concurrency] = asyncio.run(_level(target, metrics_url, images, concurrency))
    return rows, group.memory
