"""Content keys for stored embeddings: `emb:v1:<encoder_id>:<digest>`.

The digest covers the image bytes (a video's frames) and every option that changes the result
(the effective min/max pixels, the tower's dtype), so equal inputs share one key and different
preprocessing or precision never collides: a bfloat16 and a float32 encoder of one tower share
its encoder id (an LLM service accepts both), but never each other's blobs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from shared.errors import InvalidInput, clip

KEY_PREFIX = "emb:v1:"
MAX_ENCODER_ID_CHARS = 128
DIGEST_HEX_CHARS = 64  # sha256, lowercase hex
# The longest well-formed key; anything longer is refused before the pattern runs over it.
MAX_KEY_CHARS = len(KEY_PREFIX) + MAX_ENCODER_ID_CHARS + 1 + DIGEST_HEX_CHARS
_KEY_PATTERN = re.compile(
    rf"emb:v1:(?P<encoder_id>[A-Za-z0-9._-]{{1,{MAX_ENCODER_ID_CHARS}}}):(?P<digest>[0-9a-f]{{{DIGEST_HEX_CHARS}}})"
)


@dataclass(frozen=True)
class ParsedKey:
    """The parts of a well-formed key."""

    encoder_id: str
    digest: str


def embedding_key(encoder_id: str, image_bytes: bytes, min_pixels: int, max_pixels: int, *, dtype: str) -> str:
    """The key of an image encoded by `encoder_id` with these pixel bounds, by a tower in `dtype`."""
    if ":" in encoder_id:
        raise ValueError(f"encoder_id must not contain ':' ({encoder_id!r})")
    digest = hashlib.sha256()
    digest.update(f"image\0min_pixels={min_pixels}\0max_pixels={max_pixels}\0dtype={dtype}\0".encode())
    digest.update(image_bytes)
    return f"{KEY_PREFIX}{encoder_id}:{digest.hexdigest()}"


def video_key(encoder_id: str, frames: list[bytes], min_pixels: int, max_pixels: int, *, dtype: str) -> str:
    """The key of a video (its frames, in order) encoded by `encoder_id` with these per-frame bounds,
    by a tower in `dtype`.

    Each frame is length-prefixed, so no two frame lists share a digest, and the "video" tag keeps
    a one-frame video apart from the same image.
    """
    if ":" in encoder_id:
        raise ValueError(f"encoder_id must not contain ':' ({encoder_id!r})")
    digest = hashlib.sha256()
    header = f"video\0frames={len(frames)}\0min_pixels={min_pixels}\0max_pixels={max_pixels}\0dtype={dtype}\0"
    digest.update(header.encode())
    for frame in frames:
        digest.update(len(frame).to_bytes(8, "little"))
        digest.update(frame)
    return f"{KEY_PREFIX}{encoder_id}:{digest.hexdigest()}"


def parse_key(key: str, param: str = "key") -> ParsedKey:
    """The one check of a client-supplied key, made before it reaches Redis; InvalidInput when malformed.

    fullmatch, not match with `$`: `$` also matches before a trailing newline.
    """
    match = _KEY_PATTERN.fullmatch(key) if len(key) <= MAX_KEY_CHARS else None
    if match is None:
        raise InvalidInput(
            f"{clip(key)!r} is not an embedding key (expected emb:v1:<encoder_id>:<64 lowercase hex>)", param=param
        )
    return ParsedKey(match.group("encoder_id"), match.group("digest"))


def encoder_id_of_key(key: str, param: str = "key") -> str:
    """The encoder id inside a key; InvalidInput when the key is malformed (see parse_key)."""
    return parse_key(key, param).encoder_id
