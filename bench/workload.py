"""The benchmark's inputs: distinct images drawn locally, questions, and chat request bodies.

Images are 448x448 JPEGs (the benchmark checkpoint's max_pixels, 256 image tokens each) with
random shapes and noise, so each one is distinct and none compresses to nothing. A run nonce goes
into the pixels, so no image of one run is ever an encode-cache hit in another.
"""

from __future__ import annotations

import base64
import io
import random
from typing import Any

from PIL import Image, ImageDraw

QUESTIONS = (
    "What is in this image?",
    "Which colors dominate the picture?",
    "Describe the shapes you see.",
    "How many objects are there?",
    "Is there any text in the image?",
    "Where is the largest shape?",
    "What is the background like?",
    "Describe the image in one sentence.",
)


def make_image(seed: int, size: int = 448) -> bytes:
    """A JPEG of `size` x `size` with random ellipses, rectangles and noise; distinct per seed."""
    rng = random.Random(seed)
    image = Image.effect_noise((size, size), 40).convert("RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(size), rng.randrange(size)
        box = (x0, y0, x0 + rng.randrange(20, size // 2), y0 + rng.randrange(20, size // 2))
        color = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def make_images(count: int, nonce: int, size: int = 448) -> list[bytes]:
    return [make_image(nonce * 1000 + index, size) for index in range(count)]


def data_url(jpeg: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()


def chat_body(model: str, image_part: dict[str, Any], question: str, max_tokens: int) -> dict[str, Any]:
    """A streaming, greedy chat completion with one image and one question; usage at the end."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": [image_part, {"type": "text", "text": question}]}],
    }


def image_url_part(jpeg: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(jpeg)}}
