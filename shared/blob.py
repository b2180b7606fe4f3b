"""Embedding blobs: the bytes stored in Redis, and the one invariant check run on write and read.

A blob is safetensors bytes (never pickle) holding
  `image_embeds`   [tokens, hidden]  float32 | float16 | bfloat16
  `image_grid_thw` [n, 3]            int64, one (t, h, w) row per image, in patches
(`video_embeds` / `video_grid_thw` for video) and string metadata: schema, encoder_id,
modality, dtype. tokens == sum(t*h*w) // merge_size**2.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from shared.errors import IncompatibleEncoder, InvalidEmbedding, clip

SCHEMA_VERSION = "1"
Modality = Literal["image", "video"]
ALLOWED_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class EmbeddingBlob:
    embeds: torch.Tensor  # [tokens, hidden]
    grid_thw: torch.Tensor  # [n, 3] int64
    encoder_id: str
    modality: Modality = "image"

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])


@dataclass(frozen=True)
class BlobRules:
    """What a reader (or writer) requires of a blob."""

    merge_size: int
    hidden_size: int
    accepted_encoder_ids: frozenset[str]


def tokens_for_grid(grid_thw: torch.Tensor, merge_size: int) -> int:
    """Embedding rows (= prompt pad tokens) that a [n, 3] grid stands for."""
    return int(grid_thw.prod(dim=-1).sum().item()) // (merge_size**2)


def _all_finite(values: torch.Tensor) -> bool:
    # A sum is finite only if every element is, and one reduction is several times faster than
    # isfinite() over megabytes; the exact check runs only when the sum is inf/NaN (or overflowed).
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def validate_blob(blob: EmbeddingBlob, rules: BlobRules, where: str = "embedding") -> None:
    """Raises InvalidEmbedding / IncompatibleEncoder unless the blob is safe to hand to an engine."""
    if blob.encoder_id not in rules.accepted_encoder_ids:
        accepted = ", ".join(sorted(rules.accepted_encoder_ids))
        raise IncompatibleEncoder(
            f"{where} was made by encoder {clip(blob.encoder_id)!r}; this model accepts {accepted}", param=where
        )
    embeds, grid = blob.embeds, blob.grid_thw
    if embeds.ndim != 2:
        raise InvalidEmbedding(f"{where} must be 2-D [tokens, hidden], got shape {list(embeds.shape)}", param=where)
    if embeds.dtype not in ALLOWED_DTYPES:
        raise InvalidEmbedding(
            f"{where} dtype {embeds.dtype} is not one of {sorted(ALLOWED_DTYPES.values())}", param=where
        )
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] < 1 or grid.dtype != torch.int64:
        raise InvalidEmbedding(
            f"{where} grid_thw must be int64 [n, 3], got {grid.dtype} {list(grid.shape)}", param=where
        )
    if bool((grid <= 0).any()):
        raise InvalidEmbedding(f"{where} grid_thw values must be positive", param=where)
    if bool((grid.prod(dim=-1) % rules.merge_size**2 != 0).any()):
        raise InvalidEmbedding(f"{where} grid_thw t*h*w must be divisible by merge_size**2", param=where)
    expected_rows = tokens_for_grid(grid, rules.merge_size)
    if embeds.shape[0] != expected_rows:
        raise InvalidEmbedding(
            f"{where} has {embeds.shape[0]} rows but grid_thw {grid.tolist()[:4]} implies {expected_rows}", param=where
        )
    if embeds.shape[1] != rules.hidden_size:
        raise InvalidEmbedding(
            f"{where} hidden size is {embeds.shape[1]}, the model's is {rules.hidden_size}", param=where
        )
    if not _all_finite(embeds):
        raise InvalidEmbedding(f"{where} contains NaN or infinite values", param=where)


def encode_blob(blob: EmbeddingBlob, rules: BlobRules) -> bytes:
    """Validates and serializes a blob to safetensors bytes."""
    validate_blob(blob, rules)
    return serialize_unvalidated(blob)


def serialize_unvalidated(blob: EmbeddingBlob) -> bytes:
    """Serializes without checking: only for forwarding client tensors to a service that
    validates them on read (the gateway does not know each model's rules)."""
    if blob.embeds.dtype not in ALLOWED_DTYPES:
        raise InvalidEmbedding(f"embedding dtype {blob.embeds.dtype} is not one of {sorted(ALLOWED_DTYPES.values())}")
    prefix = blob.modality
    tensors = {f"{prefix}_embeds": blob.embeds.contiguous(), f"{prefix}_grid_thw": blob.grid_thw.contiguous()}
    metadata = {
        "schema": SCHEMA_VERSION,
        "encoder_id": blob.encoder_id,
        "modality": blob.modality,
        "dtype": ALLOWED_DTYPES[blob.embeds.dtype],
    }
    return save_safetensors(tensors, metadata=metadata)


def _read_metadata(data: bytes, where: str) -> dict[str, str]:
    # safetensors layout: u64 little-endian header length, then a JSON header.
    if len(data) < 8:
        raise InvalidEmbedding(f"{where} is not a safetensors blob (only {len(data)} bytes)", param=where)
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise InvalidEmbedding(f"{where} is not a safetensors blob (header overruns the data)", param=where)
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidEmbedding(f"{where} is not a safetensors blob (bad header: {error.msg})", param=where) from None
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def decode_blob(data: bytes, rules: BlobRules, where: str = "embedding") -> EmbeddingBlob:
    """Parses safetensors bytes into a validated blob; never unpickles anything."""
    metadata = _read_metadata(data, where)
    if metadata.get("schema") != SCHEMA_VERSION:
        raise InvalidEmbedding(
            f"{where} has schema {clip(str(metadata.get('schema')))!r}, expected {SCHEMA_VERSION!r}", param=where
        )
    modality = metadata.get("modality", "image")
    if modality not in ("image", "video"):
        raise InvalidEmbedding(f"{where} has unknown modality {clip(str(modality))!r}", param=where)
    try:
        tensors = load_safetensors(data)
    except SafetensorError as error:
        raise InvalidEmbedding(f"{where} is not a valid safetensors blob: {clip(str(error))}", param=where) from None
    embeds, grid = tensors.get(f"{modality}_embeds"), tensors.get(f"{modality}_grid_thw")
    if embeds is None or grid is None:
        raise InvalidEmbedding(f"{where} lacks {modality}_embeds or {modality}_grid_thw", param=where)
    blob = EmbeddingBlob(embeds, grid, metadata.get("encoder_id", ""), modality)
    validate_blob(blob, rules, where)
    return blob
