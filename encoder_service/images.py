"""Turning client bytes into a decoded RGB image, safely, upright.

Bytes that are not an image, a truncated file, or a decompression bomb are
refused with InvalidInput before more than the header is decoded. An EXIF orientation (what a
phone camera writes instead of rotating the pixels) is applied, as transformers' `load_image` and
vLLM's image loader both do: the model sees the picture as people see it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import re
import warnings

from PIL import Image, ImageOps, UnidentifiedImageError

from shared.errors import InvalidInput, ServiceError, TooLarge, clip

_BASE64_SPACES = ("\n", "\r", " ", "\t")
_DATA_URL = re.compile(r"^data:(?P<mime>image/[A-Za-z0-9.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)


def is_data_url(url: str) -> bool:
    """Whether `url` is a data URL: its scheme, as every URL scheme, in any case (RFC 3986)."""
    return url[:5].lower() == "data:"


def decode_data_url(url: str, max_bytes: int, param: str = "image_url") -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (any case, RFC 2397). The base64 may be
    broken into lines (RFC 2045 writes 76 characters a line): whitespace is dropped, nothing else."""
    match = _DATA_URL.match(url)
    if match is None:
        raise InvalidInput(
            f"data URL must look like data:image/<type>;base64,<data> (got {clip(url, 40)!r})", param=param
        )
    payload = url[match.end() :]
    if any(space in payload for space in _BASE64_SPACES):
        payload = "".join(payload.split())
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise TooLarge(f"image in data URL exceeds {max_bytes} bytes", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("data URL payload is not valid base64", param=param) from None


def load_image(data: bytes, max_decoded_pixels: int, param: str = "image") -> Image.Image:
    """Decodes image bytes to RGB. The size is checked from the header before decoding.

    Whatever Pillow raises while it reads the client's bytes is the bytes' fault, so every
    exception here is a 400: its format parsers raise more than OSError and ValueError on a
    malformed file (a DDS with unknown pixel-format flags raises NotImplementedError; fuzzing
    found it), and one that slipped through was a 500 saying nothing about the image."""
    if not data:
        raise InvalidInput("image is empty", param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_decoded_pixels:
                raise InvalidInput(
                    f"image is {width}x{height} pixels, over the limit of {max_decoded_pixels} (decompression bomb?)",
                    param=param,
                )
            image.load()
            if image.width < 1 or image.height < 1:
                raise InvalidInput("image has no pixels", param=param)
            return upright(image).convert("RGB")
    except ServiceError:
        raise
    except UnidentifiedImageError:
        raise InvalidInput("bytes are not a recognized image format", param=param) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidInput("image is a decompression bomb", param=param) from None
    except Exception as error:
        raise InvalidInput(
            f"image could not be decoded (truncated or corrupt): {type(error).__name__}: {clip(str(error), 80)}",
            param=param,
        ) from None


def upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says; as it is when it has none. A tag Pillow
    cannot read leaves the image as it is, as vLLM does: the pixels themselves are fine."""
    with contextlib.suppress(Exception):
        return ImageOps.exif_transpose(image)
    return image
