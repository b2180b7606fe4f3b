"""The yardstick: transformers' own `get_image_features` in a plain loop, no service around it.

The full model is loaded as transformers loads it (its language model is small in the benchmark
checkpoint) and called on pixel values made beforehand, so the loop times the tower and the copy
of each image's pixels to the device, nothing else. One image per call is the plain loop the
issue names; 8 and 32 images per call show what batching the stock tower could give at best
(its results are not batch-invariant, the service's are: encoder_service/batch_invariant.py).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, PreTrainedConfig, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bench.gpu.device import synchronize

# One image's input: pixel_values [patches, 3*2*14*14] float32 and grid_thw [1, 3] int64, on the CPU.
Pixels = tuple[torch.Tensor, torch.Tensor]


def pixel_inputs(checkpoint: Path, images: list[bytes]) -> list[Pixels]:
    """Each JPEG as the checkpoint's processor prepares it. The images' sides are multiples of 28
    within the processor's bounds, so nothing is resized and these are the very pixels the encoder
    service computes for them (it resizes differently from the PIL processor, never otherwise)."""
    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    inputs = []
    for jpeg in images:
        image = Image.open(io.BytesIO(jpeg)).convert("RGB")
        out = processor(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"].to(torch.int64)
        if grid[0, 1:].tolist() != [image.height // processor.patch_size, image.width // processor.patch_size]:
            raise ValueError(f"a {image.width}x{image.height} image was resized to grid {grid.tolist()}")
        inputs.append((out["pixel_values"], grid))
    return inputs


def load_config(checkpoint: Path) -> PreTrainedConfig:
    return AutoConfig.from_pretrained(checkpoint)


def load_model(checkpoint: Path, device: torch.device, dtype: torch.dtype) -> Qwen2VLForConditionalGeneration:
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint, dtype=dtype).eval()
    return model.to(device)


def encode(model: Qwen2VLForConditionalGeneration, batch: list[Pixels], device: torch.device) -> list[torch.Tensor]:
    """One `get_image_features` call on these images; [rows, hidden] per image, on the device."""
    pixel_values = torch.cat([pv for pv, _ in batch]).to(device)
    grid = torch.cat([g for _, g in batch]).to(device)
    with torch.inference_mode():
        return list(model.model.get_image_features(pixel_values, grid).pooler_output)


def time_loop(
    encode_fn: Callable[[list[Pixels]], object], inputs: list[Pixels], device: torch.device, per_call: int
) -> dict[str, Any]:
    """Encodes `inputs` through `encode_fn`, `per_call` images per call, after one untimed call of
    that size (first calls of a shape pay for kernel selection and allocation)."""
    encode_fn(inputs[:per_call])
    synchronize(device)
    started = time.perf_counter()
    for first in range(0, len(inputs), per_call):
        encode_fn(inputs[first : first + per_call])
    synchronize(device)
    elapsed = time.perf_counter() - started
    calls = -(-len(inputs) // per_call)
    return {"images": len(inputs), "calls": calls, "mean batch": len(inputs) / calls, "wall s": elapsed}


def counted_flops(model: Qwen2VLForConditionalGeneration, one: Pixels, device: torch.device) -> int:
    """torch's own count for one image, to set beside flops.py's: on a GPU it counts the matrix
    products and the fused attention kernels; on a CPU its attention kernel goes uncounted."""
    with FlopCounterMode(display=False) as counter:
        encode(model, [one], device)
    return int(counter.get_total_flops())
