"""Resizing exactly as transformers' default Qwen2-VL image processor does, without torchvision.

`AutoProcessor` (what users, the reference and vLLM use) picks the tensor-based
`Qwen2VLImageProcessor`: it resizes the uint8 image with torchvision's bicubic, antialiased
`resize`, which on uint8 CPU tensors is torch's own `interpolate(mode="bicubic", antialias=True)`.
The PIL processor resamples with Pillow instead: on an image that gets resized its pixels differ by
up to ~0.27 after normalisation, enough to change a greedy answer after a few tokens. So the
encoder resizes here, with torch, and hands the PIL processor an image already at its target size
(`do_resize=False`); rescaling, normalising and patching are the same arithmetic in both processors
(equal to 1 float32 ulp, tests/test_encoder_parity.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize


def target_size(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) the processor resizes to: multiples of `factor`, area within the bounds,
    aspect ratio kept as closely as those allow (transformers' own `smart_resize`)."""
    resized_height, resized_width = smart_resize(
        height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return int(resized_height), int(resized_width)


def resize_like_autoprocessor(image: Image.Image, height: int, width: int) -> Image.Image:
    """The RGB `image` at (height, width), resampled as `AutoProcessor`'s default processor does;
    returned as is when it already has that size."""
    if (image.height, image.width) == (height, width):
        return image
    # A writable copy: torch warns on (and must not share) the read-only buffer PIL exposes.
    pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).unsqueeze(0).contiguous()
    resized = F.interpolate(pixels, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return Image.fromarray(resized[0].permute(1, 2, 0).numpy())
