"""Deterministic test images, as file bytes and data URLs."""

from __future__ import annotations

import base64
import io

from PIL import Image

from tests.model_fixtures import make_image


def png_bytes(seed: int, size: tuple[int, int] = (84, 112)) -> bytes:
    """A random-noise RGB PNG; different seeds give different embeddings."""
    buffer = io.BytesIO()
    make_image(seed, *size).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def pil_image(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def with_orientation(image: Image.Image, orientation: int, fmt: str = "JPEG") -> bytes:
    """The image's pixels as they are, saved with an EXIF orientation tag (1-8), as phone cameras
    save photos: viewers (and transformers' and vLLM's loaders) turn it upright when shown."""
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    buffer = io.BytesIO()
    image.save(buffer, fmt, exif=exif)
    return buffer.getvalue()
