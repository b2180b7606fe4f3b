"""Embedding blobs: the bytes stored in Redis, and the one invariant check run on write and read.

A blob is safetensors bytes (never pickle) holding
  `image_embeds`   [tokens, hidden]  float32 | float16 | bfloat16
  `image_grid_thw` [n, 3]            int64, one (t, h, w) row per image, in patches
(`video_embeds` / `video_grid_thw` for video) and string metadata: schema, encoder_id,
modality, dtype. tokens == sum(t*h*w) // merge_size**2.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from shared.errors import IncompatibleEncoder, InvalidEmbedding, clip

SCHEMA_VERSION = "1"
Modality = Literal["image", "video"]
_Layout = tuple[torch.dtype, tuple[int, ...], int, int]  # dtype, shape, begin, end (from the data start)
ALLOWED_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_EXPONENT_BITS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
# safetensors dtype names; a blob holding another kind of tensor is refused as malformed.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BOOL": torch.bool,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
}  # fmt: skip
# decode_blob's tensors are views of the fetched bytes, which cannot be made writable without the
# copy we avoid; torch warns once per process that it cannot mark such tensors read-only. They are
# only ever read (engines copy them with cat), so that one warning is taken here, silenced.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(b"\0", dtype=torch.uint8)


@dataclass(frozen=True)
class EmbeddingBlob:
    """Decoded blobs share memory with the bytes they came from: read their tensors, never write
    them in place (copy first)."""

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
    return sum(math.prod(row) for row in grid_thw.tolist()) // (merge_size**2)


def _all_finite(values: torch.Tensor) -> bool:
    # In numpy, not torch: torch splits a reduction over its OpenMP threads, and on a busy machine
    # waking them costs milliseconds, far more than the work itself (measured under load: 8-12 ms
    # against 0.3 ms for a 0.8 MB float32 blob). float32: a sum is finite only if every element
    # is, and one reduction is several times faster than isfinite() over megabytes; the exact
    # check runs only when the sum is inf/NaN (or overflowed). 16-bit floats (numpy sums them
    # slowly, or not at all): a value is finite iff its exponent bits are not all ones.
    if values.device.type != "cpu":
        return bool(torch.isfinite(values).all())
    values = values.detach()
    if values.numel() == 0:
        return True
    exponent = _EXPONENT_BITS.get(values.dtype)
    if exponent is not None:
        bits = values.view(torch.int16).numpy().view(np.uint16)
        return int((bits & exponent).max()) != exponent
    array = values.numpy().reshape(-1)
    with np.errstate(all="ignore"):  # an overflowing sum is expected, and answered below
        # einsum's plain SIMD sum is twice as fast as sum()'s pairwise one; only finiteness matters.
        return bool(np.isfinite(np.einsum("i->", array))) or bool(np.isfinite(array).all())


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
    # The grid is a few numbers: Python arithmetic on one tolist() beats several tiny torch ops.
    rows = grid.tolist()
    if any(value <= 0 for row in rows for value in row):
        raise InvalidEmbedding(f"{where} grid_thw values must be positive", param=where)
    patches = [math.prod(row) for row in rows]
    if any(count % rules.merge_size**2 != 0 for count in patches):
        raise InvalidEmbedding(f"{where} grid_thw t*h*w must be divisible by merge_size**2", param=where)
    expected_rows = sum(patches) // rules.merge_size**2
    if embeds.shape[0] != expected_rows:
        raise InvalidEmbedding(
            f"{where} has {embeds.shape[0]} rows but grid_thw {rows[:4]} implies {expected_rows}", param=where
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


def split_safetensors_header(data: bytes, where: str) -> tuple[bytes, int]:
    """The JSON header's bytes and the offset where tensor data starts."""
    # safetensors layout: u64 little-endian header length, a JSON header, then the tensor bytes.
    if len(data) < 8:
        raise InvalidEmbedding(f"{where} is not a safetensors blob (only {len(data)} bytes)", param=where)
    (header_len,) = struct.unpack_from("<Q", data)
    if header_len > len(data) - 8:
        raise InvalidEmbedding(f"{where} is not a safetensors blob (header overruns the data)", param=where)
    return data[8 : 8 + header_len], 8 + header_len


def parse_safetensors_header(header: bytes, data_len: int) -> tuple[dict[str, Any], dict[str, _Layout]]:
    """(metadata, layout) of a safetensors header; raises ValueError naming the first problem.

    Blobs of one encoder and one image size share their header byte for byte, so recent headers
    are parsed once (_parse_header_cached): on a 0.8 MB blob, parsing is a quarter of decoding."""
    if len(header) <= _CACHED_HEADER_BYTES:
        return _parse_header_cached(header, data_len)
    return _parse_header_uncached(header, data_len)


def _parse_header_uncached(header: bytes, data_len: int) -> tuple[dict[str, Any], dict[str, _Layout]]:
    try:
        parsed = json.loads(header)
    except json.JSONDecodeError as error:
        raise ValueError(f"bad header: {error.msg}") from None
    except UnicodeDecodeError:
        raise ValueError("bad header: not UTF-8") from None
    parsed = parsed if isinstance(parsed, dict) else {}
    metadata = parsed.get("__metadata__")
    return (metadata if isinstance(metadata, dict) else {}), _tensor_layout(parsed, data_len)


# Normal headers are ~300 bytes; larger ones (only hostile or foreign blobs) are not kept.
_CACHED_HEADER_BYTES = 4096
# Callers only read what it returns (see decode_blob).
_parse_header_cached = functools.lru_cache(maxsize=256)(_parse_header_uncached)


def _tensor_layout(header: dict[str, Any], data_len: int) -> dict[str, _Layout]:
    """name -> (dtype, shape, begin, end), offsets from the data start, checked as safetensors
    checks them: known dtypes, sizes that match shapes, no gap or overlap, data fully covered.
    Raises ValueError naming the first problem."""
    layout = {}
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ValueError("__metadata__ must map strings to strings")
            continue
        try:
            dtype, shape, (begin, end) = _SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} lacks a known dtype, a shape or two data_offsets") from None
        if not isinstance(shape, list) or not all(type(v) is int and v >= 0 for v in [*shape, begin, end]):
            raise ValueError(f"tensor {name!r} has a bad shape or data_offsets")
        if math.prod(shape) * dtype.itemsize != end - begin:
            raise ValueError(f"tensor {name!r}: shape {shape} of {entry['dtype']} does not fill bytes {begin}..{end}")
        layout[name] = (dtype, tuple(shape), begin, end)
    position = 0
    for _, _, begin, end in sorted(layout.values(), key=lambda item: item[2]):
        if begin != position:
            raise ValueError("tensor data overlaps or leaves a gap")
        position = end
    if position != data_len:
        raise ValueError(f"tensors cover {position} bytes of {data_len}")
    return layout


def tensor_view(
    data: bytes, start: int, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int
) -> torch.Tensor:
    """A tensor over data[start + begin : start + end], sharing its memory (copied only if misaligned).
    safetensors data is little-endian, as every host we run on is."""
    if begin == end:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses zero bytes
    raw = torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=start + begin)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).reshape(shape)


def decode_blob(data: bytes, rules: BlobRules, where: str = "embedding") -> EmbeddingBlob:
    """Parses safetensors bytes into a validated blob; never unpickles anything.

    Zero-copy: the tensors are views of `data`, which they keep alive (see EmbeddingBlob)."""
    header, start = split_safetensors_header(data, where)
    try:
        metadata, layout = parse_safetensors_header(header, len(data) - start)
    except ValueError as error:
        raise InvalidEmbedding(f"{where} is not a valid safetensors blob: {clip(str(error))}", param=where) from None
    if metadata.get("schema") != SCHEMA_VERSION:
        raise InvalidEmbedding(
            f"{where} has schema {clip(str(metadata.get('schema')))!r}, expected {SCHEMA_VERSION!r}", param=where
        )
    modality = metadata.get("modality", "image")
    if modality not in ("image", "video"):
        raise InvalidEmbedding(f"{where} has unknown modality {clip(str(modality))!r}", param=where)
    embeds, grid = layout.get(f"{modality}_embeds"), layout.get(f"{modality}_grid_thw")
    if embeds is None or grid is None:
        raise InvalidEmbedding(f"{where} lacks {modality}_embeds or {modality}_grid_thw", param=where)
    blob = EmbeddingBlob(
        tensor_view(data, start, *embeds), tensor_view(data, start, *grid), metadata.get("encoder_id", ""), modality
    )
    validate_blob(blob, rules, where)
    return blob
