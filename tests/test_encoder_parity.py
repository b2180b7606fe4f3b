"""The encoder's pixels are the ones transformers' default processor makes (`AutoImageProcessor`,
what AutoProcessor, users and vLLM use: the torchvision-backed Qwen2VLImageProcessor), on images
that get resized, at default and at custom pixel bounds. Before encoder_service/pixels.py, the
encoder resampled with Pillow and differed by up to ~0.27 on a 100x60 image."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.image_utils import load_image as transformers_load_image

from encoder_service.images import load_image
from encoder_service.vision import VisionEncoder
from tests.images import data_url, with_orientation
from tests.model_fixtures import make_image

pytest.importorskip("torchvision", reason="transformers' default Qwen2-VL processor needs torchvision")

# (width, height): not multiples of 28, so all but the last get resized; one shrinks past max_pixels.
SIZES = [(100, 60), (333, 217), (29, 500), (1500, 1100), (84, 112)]
ULP = 1e-6  # both normalise in float32; they may round the last bit differently


@pytest.fixture(scope="module")
def encoder(checkpoints: dict[str, Path]) -> VisionEncoder:
    return VisionEncoder.load(str(checkpoints["base"]), "cpu", torch.float32)


@pytest.fixture(scope="module")
def default_processor(checkpoints: dict[str, Path]) -> object:
    processor = AutoImageProcessor.from_pretrained(checkpoints["base"])
    assert type(processor).__name__ == "Qwen2VLImageProcessor", type(processor)  # the tensor-based default
    return processor


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_pixels_equal_the_default_processors(
    encoder: VisionEncoder, default_processor, width: int, height: int
) -> None:  # type: ignore[no-untyped-def]
    image = make_image(300 + width, width, height)
    pixels, grid = encoder.preprocess(image)
    expected = default_processor(images=[image], return_tensors="pt")
    assert grid.tolist() == expected["image_grid_thw"].tolist()
    assert float((pixels - expected["pixel_values"]).abs().max()) <= ULP


def test_pixels_equal_at_custom_bounds(encoder: VisionEncoder, default_processor) -> None:  # type: ignore[no-untyped-def]
    image = make_image(77, 640, 480)
    low, high = 56 * 56, 28 * 28 * 40
    pixels, grid = encoder.preprocess(image, min_pixels=low, max_pixels=high)
    expected = default_processor(images=[image], size={"shortest_edge": low, "longest_edge": high}, return_tensors="pt")
    assert grid.tolist() == expected["image_grid_thw"].tolist()
    assert float((pixels - expected["pixel_values"]).abs().max()) <= ULP


@pytest.mark.parametrize("orientation", range(1, 9))
def test_an_exif_orientation_is_applied_as_transformers_load_image_does(
    encoder: VisionEncoder, default_processor, orientation: int
) -> None:  # type: ignore[no-untyped-def]
    """A photo whose EXIF says "rotate 90" is encoded upright: transformers' `load_image` (what its
    processors do with a URL or base64 image) and vLLM's loader both turn it. Orientations 5-8
    swap width and height, so the grid shows it too; before encoder_service/images.py applied
    the tag, the encoder saw the pixels as stored."""
    data = with_orientation(make_image(orientation, 100, 60), orientation, fmt="PNG")
    pixels, grid = encoder.preprocess(load_image(data, max_decoded_pixels=10**6))
    expected = default_processor(images=[transformers_load_image(data_url(data))], return_tensors="pt")
    assert grid.tolist() == expected["image_grid_thw"].tolist()
    assert float((pixels - expected["pixel_values"]).abs().max()) <= ULP


def _in_mode(mode: str) -> tuple[bytes, str]:
    """A 100x60 noise image stored in `mode` (PNG, or JPEG for CMYK), with transparency where the
    mode has it: half the pixels fully transparent over colours that are not white."""
    rgb = make_image(900 + len(mode), 100, 60)
    alpha = Image.fromarray((np.arange(100 * 60).reshape(60, 100) % 2 * 255).astype(np.uint8), mode="L")
    buffer = io.BytesIO()
    if mode == "CMYK":
        rgb.convert("CMYK").save(buffer, format="JPEG", quality=95)
        return buffer.getvalue(), "image/jpeg"
    if mode in ("RGBA", "LA"):
        image = rgb.convert(mode[:-1])
        image.putalpha(alpha)
    elif mode == "P+tRNS":  # a palette whose colour 0 is transparent
        image = rgb.quantize(64)
        image.info["transparency"] = 0
    elif mode == "I;16":
        image = Image.fromarray(np.asarray(rgb.convert("L"), dtype=np.uint16) * 257)  # 16-bit grey
    else:
        image = rgb.convert(mode)
    image.save(buffer, format="PNG", **({"transparency": 0} if mode == "P+tRNS" else {}))
    return buffer.getvalue(), "image/png"


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P+tRNS", "L", "1", "I;16", "CMYK"])
def test_every_pixel_mode_becomes_the_pixels_transformers_load_image_gives(
    encoder: VisionEncoder, default_processor, mode: str
) -> None:  # type: ignore[no-untyped-def]
    """Transparency, palettes, grey, 1-bit, 16-bit and CMYK come out as transformers' `load_image`
    makes them (`convert("RGB")`: transparent pixels keep their colour; vLLM's loader pastes them
    on white instead: README, the paragraph on EXIF orientation)."""
    data, mime = _in_mode(mode)
    pixels, grid = encoder.preprocess(load_image(data, max_decoded_pixels=10**6))
    expected = default_processor(images=[transformers_load_image(data_url(data, mime))], return_tensors="pt")
    assert grid.tolist() == expected["image_grid_thw"].tolist()
    assert float((pixels - expected["pixel_values"]).abs().max()) <= ULP
