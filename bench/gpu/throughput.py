"""Encoder throughput: the plain loop (tower_loop.py), our encoder's tower in-process (ours_loop.py)
and the service (service_load.py) on one table, each row with its images/s and the FLOP utilisation
that amounts to (flops.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.gpu import tower_loop
from bench.gpu.device import peak_memory_gib
from bench.gpu.flops import tower_flops, utilisation
from bench.gpu.ours_loop import measure_ours
from bench.gpu.service_load import ServiceSetup, run_service
from bench.outcome import ScenarioResult, Target
from bench.stats import ratio
from bench.workload import make_images
from encoder_service.settings import EncoderSettings

COLUMNS = ["images", "calls", "mean batch", "wall s", "images/s", "TFLOP/s", "FLOP utilisation",
           "p50 latency ms", "p90 latency ms", "tower ms per pass", "tower busy"]  # fmt: skip
# Seeds of each group of images (bench.workload): no image is seen twice in a run.
LOOP_NONCE, WARM_NONCE, LEVEL_NONCE = 1, 2, 10
DEFAULT_CUDA_GRAPHS = int(EncoderSettings.model_fields["cuda_graphs"].default)


@dataclass(frozen=True)
class Workload:
    images: int  # per row of the table
    image_size: int  # side in pixels; a multiple of 28 (no resize)
    per_call: tuple[int, ...]  # images per get_image_features call in the plain loop
    concurrency: tuple[int, ...]  # calls in flight through the service
    peak_flops: float  # the device's dense bf16 peak, FLOP/s


def new_result(checkpoint: Path, device: torch.device, dtype: torch.dtype, work: Workload) -> ScenarioResult:
    model_config = tower_loop.load_config(checkpoint)
    grid = (1, work.image_size // 14, work.image_size // 14)
    flops = tower_flops(model_config.vision_config, [grid])
    return ScenarioResult(
        "encoder", f"Encoder throughput: 2B-shaped vision tower, {str(dtype).removeprefix('torch.')}, "
        f"{work.image_size}x{work.image_size}, on {device.type}", COLUMNS, {},
        config={"checkpoint": str(checkpoint), "images per row": work.images, "grid": list(grid),
                "FLOPs per image (flops.py)": flops, "peak TFLOP/s": work.peak_flops / 1e12},
    )  # fmt: skip


def _with_rates(row: dict[str, Any], result: ScenarioResult) -> dict[str, Any]:
    flops = int(result.config["FLOPs per image (flops.py)"])
    images_per_s = ratio(row["images"], row["wall s"])
    return {
        **row,
        "images/s": images_per_s,
        "TFLOP/s": flops * images_per_s / 1e12,
        "FLOP utilisation": utilisation(flops, images_per_s, float(result.config["peak TFLOP/s"]) * 1e12),
    }


def measure_loop(
    result: ScenarioResult, checkpoint: Path, device: torch.device, dtype: torch.dtype, work: Workload
) -> tuple[tuple[torch.Tensor, torch.Tensor], list[ScenarioResult]]:
    """The plain loop's rows and our encoder's in-process rows, in `result`; returns the first
    image's embeddings on the device and its grid (the round trip's payload: [256, 1536] bf16 at
    448x448), and the bit-equality checks of our encoder (ours_loop.py)."""
    model = tower_loop.load_model(checkpoint, device, dtype)
    inputs = tower_loop.pixel_inputs(checkpoint, make_images(work.images, LOOP_NONCE, work.image_size))
    for per_call in work.per_call:
        row = tower_loop.time_loop(partial(tower_loop.encode, model, device=device), inputs, device, per_call)
        name = (
            "get_image_features loop, 1 image per call" if per_call == 1 else f"get_image_features, {per_call} per call"
        )
        result.rows[name] = _with_rates(row, result)
    result.config["FLOPs per image (torch FlopCounterMode)"] = tower_loop.counted_flops(model, inputs[0], device)
    result.config["peak device memory GiB (loop)"] = peak_memory_gib(device)
    (embeds,) = tower_loop.encode(model, inputs[:1], device)
    embeds = embeds.clone()
    del model
    checks = []
    # On a GPU the service replays CUDA graphs by default; the eager rows show what they save.
    for graphs, how in [(DEFAULT_CUDA_GRAPHS, "CUDA graphs"), (0, "eager")] if device.type == "cuda" else [(0, "")]:
        ours, invariance = measure_ours(checkpoint, device, dtype, inputs, work.per_call, embeds, graphs)
        checks.append(invariance)
        for per_call, row in ours.items():
            name = f"our encoder in-process{', ' + how if how else ''}, {per_call} per call"
            result.rows[name] = _with_rates(row, result)
    return (embeds, inputs[0][1]), checks


def measure_service(result: ScenarioResult, setup: ServiceSetup, work: Workload) -> None:
    """The service rows, in `result`, and the comparison with the plain loop."""
    levels = {c: make_images(work.images, LEVEL_NONCE + c, work.image_size) for c in work.concurrency}
    warm_up = make_images(max(work.concurrency), WARM_NONCE, work.image_size)
    rows, memory = run_service(setup, levels, warm_up, warmup_pixels=work.image_size**2)
    for concurrency, row in rows.items():
        result.rows[f"encoder service, concurrency {concurrency}"] = _with_rates(row, result)
    result.memory = memory
    result.config["service max_batch_size"] = setup.max_batch_size
    loop = result.rows.get("get_image_features loop, 1 image per call")
    if loop is None:
        return
    for concurrency in work.concurrency:
        speedup = ratio(result.rows[f"encoder service, concurrency {concurrency}"]["images/s"], loop["images/s"])
        result.ratios[f"service at concurrency {concurrency} / plain loop, images/s"] = speedup
    best = max(result.ratios.values())
    # The issue sets no number; >= 1 says the service, batcher included, is no slower than a plain loop.
    result.targets.append(
        Target("best service images/s / plain loop (sanity check, no issue target)", best, ">=", 1.0, "x")
    )
