"""Our encoder's tower in-process, on the plain loop's pixels: `VisionEncoder.encode_batch`, which
the service runs on each batch. It is batch-invariant (encoder_service/batch_invariant.py: every
shape-sensitive submodule runs once per image) and copies each result to the CPU, as the service
does. On a GPU it runs twice: with CUDA graphs (the service's default, encoder_service/cuda_graphs.py:
each image replays its grid's graph alone) and eagerly. Between the plain loop's rows and the
service's, these rows separate what our tower costs on this device from what the service adds (JPEG
decoding, preprocessing, the batcher, gRPC, the blob, Redis).

It also checks, on this device, the two promises stored blobs rest on: an image encoded alone gives
the unmodified tower's bits (transformers' `get_image_features`, from the plain loop), and the same
bits whichever images share its batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.gpu.tower_loop import Pixels, time_loop
from bench.outcome import ScenarioResult, Target
from encoder_service.vision import VisionEncoder


def measure_ours(
    checkpoint: Path,
    device: torch.device,
    dtype: torch.dtype,
    inputs: list[Pixels],
    per_call: tuple[int, ...],
    stock_first: torch.Tensor,
    cuda_graphs: int,
) -> tuple[dict[int, dict[str, Any]], ScenarioResult]:
    """({images per call: timed row}, the bit-equality checks). `stock_first` is the unmodified
    tower's output for inputs[0] alone; `cuda_graphs` is the service's ENCODER_CUDA_GRAPHS."""
    encoder = VisionEncoder.load(str(checkpoint), device=str(device), dtype=dtype, cuda_graphs=cuda_graphs)
    for _ in range(2):  # a grid is captured on its second sighting: before the clock, not inside it
        encoder.encode_batch(inputs[:1])
    rows = {n: time_loop(encoder.encode_batch, inputs, device, n) for n in per_call}
    alone = encoder.encode_batch(inputs[:1])[0]
    batch_size = max(per_call)
    in_batch = encoder.encode_batch(inputs[:batch_size])
    singles = [encoder.encode_batch([item])[0] for item in inputs[:batch_size]]
    invariant = sum(torch.equal(a, b) for a, b in zip(in_batch, singles, strict=True))
    stock = stock_first.to("cpu")
    how = "CUDA graphs" if encoder.graphs is not None else "eager"
    checks = ScenarioResult(
        f"invariance-{how.replace(' ', '-').lower()}",
        f"Our encoder on {device.type}, {how}: the stock tower's bits, whatever the batch",
        ["largest difference from stock", "largest stock value"],
        {"first image alone": {"largest difference from stock": (alone.float() - stock.float()).abs().max().item(),
                               "largest stock value": stock.float().abs().max().item()}},
        config={"dtype": str(dtype).removeprefix("torch."), "batch": batch_size},
    )  # fmt: skip
    checks.targets += [
        Target(
            "an image alone equals get_image_features' bits (1 = yes; not promised where a CPU widens bfloat16 products)",
            float(torch.equal(alone, stock)),
            "==",
            1.0,
        ),
        Target(f"images of a {batch_size}-image batch equal to each encoded alone", invariant, "==", batch_size),
    ]
    if encoder.graphs is not None:
        checks.config["graphs captured"] = encoder.graphs.captured
        checks.targets.append(
            Target("CUDA graphs on after the run (1 = yes; a failed capture turns them off)",
                   float(encoder.graphs.enabled), "==", 1.0)
        )  # fmt: skip
    return rows, checks
