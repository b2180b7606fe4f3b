"""Content keys for stored embeddings: `emb:v1:<encoder_id>:<digest>`.

The digest covers the image bytes (a video's frames) and every option that changes the result
(the effective min/max pixels), so equal inputs share one key and different
preprocessing never collides.
"""

from __future__ import annotations

import hashlib
import re

from shared.errors import InvalidInput, clip

KEY_PREFIX = "emb:v1:"
_KEY_PATTERN = re.compile(r"^emb:v1:(?P<encoder_id>[A-Za-z0-9._-]{1,128}):(?P<digest>[0-9a-f]{64})$")


def embedding_key(encoder_id: str, image_bytes: bytes, min_pixels: int, max_pixels: int) -> str:
    """The key of an image encoded by `encoder_id` with these pixel bounds."""
    if ":" in encoder_id:
        raise ValueError(f"encoder_id must not contain ':' ({encoder_id!r})")
    digest = hashlib.sha256()
    digest.update(f"image\0min_pixels={min_pixels}\0max_pixels={max_pixels}\0".encode())
    digest.update(image_bytes)
    return f"{KEY_PREFIX}{encoder_id}:{digest.hexdigest()}"


def video_key(encoder_id: str, frames: list[bytes], min_pixels: int, max_pixels: int) -> str:
    """The key of a video (its frames, in order) encoded by `encoder_id` with these per-frame bounds.

    Each frame is length-prefixed, so no two frame lists share a digest, and the "video" tag keeps
    a one-frame video apart from the same image.
    """
    if ":" in encoder_id:
        raise ValueError(f"encoder_id must not contain ':' ({encoder_id!r})")
    digest = hashlib.sha256()
    digest.update(f"video\0frames={len(frames)}\0min_pixels={min_pixels}\0max_pixels={max_pixels}\0".encode())
    for frame in frames:
        digest.update(len(frame).to_bytes(8, "little"))
        digest.update(frame)
    return f"{KEY_PREFIX}{encoder_id}:{digest.hexdigest()}"


def encoder_id_of_key(key: str, param: str = "key") -> str:
    """The encoder id inside a key; InvalidInput when the key is malformed."""
    match = _KEY_PATTERN.match(key)
    if match is None:
        raise InvalidInput(
            f"{clip(key)!r} is not an embedding key (expected emb:v1:<encoder_id>:<sha256>)", param=param
        )
    return match.group("encoder_id")
