"""The blob round trip between devices: embeddings on the encoder's GPU -> blob -> Redis -> blob ->
tensor on the LLM's GPU, through the functions the services run, checked bit for bit.

Stages, each timed on its own (the device synchronised before a clock is read):
- to blob: `blob_from_tensors`, which copies the rows to host memory (the encoder, after its pass);
- encode: `encode_blob`, the invariants and the safetensors bytes;
- SET / GET: `EmbeddingStore.put` and `get_many`, the services' async Redis client;
- decode: `decode_blob`, zero-copy views of the fetched bytes, checked again;
- to device: `embeds_tensor(...).to(device)`, as an engine moves rows before scattering them.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from bench.gpu.device import synchronize
from bench.outcome import ScenarioResult, Target
from bench.stats import median, percentile
from encoder_service.blob_arrays import blob_from_tensors
from llm_service.blob_tensors import embeds_tensor, grid_tensor
from shared.blob import BlobRules, decode_blob, encode_blob
from shared.keys import embedding_key
from shared.store import EmbeddingStore, StoreConfig

STAGES = ("to blob", "encode", "SET", "GET", "decode", "to device")
ENCODER_ID = "roundtrip"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The values' bits, so that equality is bitwise (NaN == NaN, -0.0 != 0.0)."""
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


async def _trips(
    embeds: torch.Tensor, grid: torch.Tensor, redis_url: str, trips: int
) -> tuple[list[dict[str, float]], int, int]:
    """Per-trip stage times (s), the trips that came back bit for bit, and the blob's size."""
    device = embeds.device
    rules = BlobRules(2, embeds.shape[1], frozenset({ENCODER_ID}))
    store = EmbeddingStore(StoreConfig(url=redis_url))
    times, exact, size = [], 0, 0
    try:
        for trip in range(trips):
            key = embedding_key(ENCODER_ID, f"trip {trip}".encode(), 0, 0, dtype="bfloat16")
            synchronize(device)
            clock = [time.perf_counter()]
            blob = blob_from_tensors(embeds, grid, ENCODER_ID, "image")
            clock.append(time.perf_counter())
            data = encode_blob(blob, rules)
            clock.append(time.perf_counter())
            await store.put(key, data)
            clock.append(time.perf_counter())
            (fetched,) = await store.get_many([key])
            clock.append(time.perf_counter())
            assert fetched is not None, f"{key} vanished from Redis"
            decoded = decode_blob(fetched, rules)
            clock.append(time.perf_counter())
            back = embeds_tensor(decoded).to(device)
            synchronize(device)
            clock.append(time.perf_counter())
            times.append({stage: clock[i + 1] - clock[i] for i, stage in enumerate(STAGES)})
            exact += bool(torch.equal(_bits(back), _bits(embeds))) and torch.equal(grid_tensor(decoded), grid.cpu())
            size = len(data)
            await store.delete(key)
    finally:
        await store.aclose()
    return times, exact, size


def run_roundtrip(
    embeds: torch.Tensor, grid: torch.Tensor, redis_url: str, trips: int, warm_up: int = 3
) -> ScenarioResult:
    """embeds [rows, hidden] on the device (the tower's output), grid [1, 3] int64."""
    times, exact, size = asyncio.run(_trips(embeds, grid, redis_url, warm_up + trips))
    timed = times[warm_up:]
    rows: dict[str, dict[str, Any]] = {}
    for stage in (*STAGES, "total"):
        samples = [sum(t.values()) if stage == "total" else t[stage] for t in timed]
        rows[stage] = {"p50 ms": median(samples) * 1000, "p90 ms": percentile(samples, 90) * 1000}
    result = ScenarioResult(
        "roundtrip", f"Blob round trip {embeds.device.type} -> Redis -> {embeds.device.type}", ["p50 ms", "p90 ms"], rows,
        config={"embeds": f"{list(embeds.shape)} {str(embeds.dtype).removeprefix('torch.')}", "blob bytes": size,
                "trips timed": len(timed), "warm-up trips": warm_up},
    )  # fmt: skip
    result.targets.append(Target("trips back bit for bit (all, warm-up included)", exact, "==", len(times)))
    total = median([sum(t.values()) for t in timed])
    result.ratios["effective GB/s (blob bytes / p50 total)"] = size / total / 1e9 if total else float("nan")
    return result
