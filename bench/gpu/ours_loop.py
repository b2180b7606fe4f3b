"""Our encoder's tower in-process, on the plain loop's pixels: `VisionEncoder.encode_batch`, which
the service runs on each batch. It is batch-invariant (encoder_service/batch_invariant.py: every
shape-sensitive submodule runs once per image) and copies each result to the CPU, as the service
does. Between the plain loop's rows and the service's, these rows separate what batch invariance
costs on this device from what the service adds (JPEG decoding, preprocessing, the batcher, gRPC,
the blob, Redis).

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
) -> tuple[dict[int, dict[str, Any]], ScenarioResult]:
    """({images per call: timed row}, the bit-equality checks). `stock_first` is the unmodified
    tower's output for inputs[0] alone."""
    encoder = VisionEncoder.load(str(checkpoint), device=str(device), dtype=dtype)
    rows = {n: time_loop(encoder.encode_batch, inputs, device, n) for n in per_call}
    alone = encoder.encode_batch(inputs[:1])[0]
    batch_size = max(per_call)
    in_batch = encoder.encode_batch(inputs[:batch_size])
    singles = [encoder.encode_batch([item])[0] for item in inputs[:batch_size]]
    invariant = sum(torch.equal(a, b) for a, b in zip(in_batch, singles, strict=True))
    stock = stock_first.to("cpu")
    checks = ScenarioResult(
        "invariance",
        f"Our encoder on {device.type}: the stock tower's bits, whatever the batch",
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
    return rows, checks
