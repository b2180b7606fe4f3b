"""Training batches: task images through the encoder's own preprocessing, labels per task.

Images go through `preprocess_image`, the function the encoder serves with, so the tower learns
exactly the pixels it will see. A share of images is anti-aliased or JPEG-compressed: clients draw
and send such images with their own code.
"""

from __future__ import annotations

import io
import random

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoder_service.vision import preprocess_image
from model_builders.shapes.task import COLORS, COUNTS, KINDS, Scene, random_scene, render

ANTIALIAS_SHARE = 0.3
JPEG_SHARE = 0.15
# Class offsets of the three heads in one logits row: colour, count, kind.
HEADS = {
    "color": (0, len(COLORS)),
    "count": (len(COLORS), len(COUNTS)),
    "shape": (len(COLORS) + len(COUNTS), len(KINDS)),
}
NUM_CLASSES = len(COLORS) + len(COUNTS) + len(KINDS)


def labels(scene: Scene) -> tuple[int, int, int]:
    return tuple(COLORS).index(scene.color), COUNTS.index(scene.count), KINDS.index(scene.kind)


def training_image(rng: random.Random) -> tuple[Image.Image, Scene]:
    scene = random_scene(rng)
    image = render(scene, antialias=rng.random() < ANTIALIAS_SHARE)
    if rng.random() < JPEG_SHARE:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=rng.randint(70, 95))
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    return image, scene


def pixel_batch(processor: Qwen2VLImageProcessorPil, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [patches, C*T*P*P] and grid_thw [n, 3] of `images`, concatenated as the tower takes them."""
    items = [preprocess_image(processor, image) for image in images]
    return torch.cat([pv for pv, _ in items]), torch.cat([grid for _, grid in items])
