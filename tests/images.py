"""Deterministic test images, as file bytes and data URLs."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def png_bytes(seed: int, size: tuple[int, int] = (84, 112)) -> bytes:
    """A random-noise RGB PNG; different seeds give different embeddings."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def pil_image(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")
