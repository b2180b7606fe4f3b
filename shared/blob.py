"""Embedding blobs: the bytes stored in Redis, and the one invariant check run on write and read.

A blob is safetensors bytes (never pickle) holding
  `image_embeds`   [tokens, hidden]  float32 | float16 | bfloat16
  `image_grid_thw` [n, 3]            int64, one (t, h, w) row per image, in patches
(`video_embeds` / `video_grid_thw` for video) and string metadata: schema, encoder_id,
modality, dtype. tokens == sum(t*h*w) // merge_size**2.

The codec works on bytes and numpy, never torch: the gateway checks and forwards blobs without
loading it. Torch tensors are made where they are needed: from the vision tower's output in the
encoder (encoder_service/blob_arrays.py), for an engine in the LLM service (llm_service/blob_tensors.py).
numpy has no bfloat16, so a bfloat16 blob holds its values' bits as uint16 (the bytes safetensors
stores for BF16), and `EmbeddingBlob.dtype` says which float the array stands for.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from shared.errors import IncompatibleEncoder, InvalidEmbedding, clip

SCHEMA_VERSION = "1"
Modality = Literal["image", "video"]
EmbedDtype = Literal["float32", "float16", "bfloat16"]
Array = npt.NDArray[Any]
# The array each embedding dtype is held in (little-endian, as safetensors stores data).
EMBED_ARRAYS: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
}  # fmt: skip
# A 16-bit float is finite iff its exponent bits are not all ones.
_EXPONENT_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80}
# safetensors dtype -> (our dtype name, the numpy array holding it). 8-bit floats, like bfloat16,
# are held as their bits. A blob holding anything but the embedding dtypes and an int64 grid is
# refused by validate_blob, with the name in its message.
_SAFETENSORS_DTYPES: dict[str, tuple[str, np.dtype[Any]]] = {
    "F64": ("float64", np.dtype("<f8")), "F32": ("float32", np.dtype("<f4")),
    "F16": ("float16", np.dtype("<f2")), "BF16": ("bfloat16", np.dtype("<u2")),
    "F8_E4M3": ("float8_e4m3fn", np.dtype("u1")), "F8_E5M2": ("float8_e5m2", np.dtype("u1")),
    "BOOL": ("bool", np.dtype("?")),
    "I64": ("int64", np.dtype("<i8")), "I32": ("int32", np.dtype("<i4")),
    "I16": ("int16", np.dtype("<i2")), "I8": ("int8", np.dtype("i1")),
    "U64": ("uint64", np.dtype("<u8")), "U32": ("uint32", np.dtype("<u4")),
    "U16": ("uint16", np.dtype("<u2")), "U8": ("uint8", np.dtype("u1")),
}  # fmt: skip
# Our dtype name -> safetensors dtype, for writing.
_SAFETENSORS_NAMES = {name: code for code, (name, _) in _SAFETENSORS_DTYPES.items()}
_Layout = tuple[str, tuple[int, ...], int, int]  # safetensors dtype, shape, begin, end (from the data start)


@dataclass(frozen=True)
class EmbeddingBlob:
    """`embeds` [tokens, hidden] is a float32 or float16 array, or for "bfloat16" the values' bits
    as uint16; `dtype` names which. Decoded blobs share memory with the bytes they came from (their
    arrays are read-only): read them, never write them in place (copy first)."""

    embeds: Array  # [tokens, hidden]
    grid_thw: Array  # [n, 3] int64
    encoder_id: str
    modality: Modality = "image"
    dtype: str = "float32"  # an EmbedDtype once validated; a decoded blob may name any other

    @property
    def num_tokens(self) -> int:
        return int(self.embeds.shape[0])


@dataclass(frozen=True)
class BlobRules:
    """What a reader (or writer) requires of a blob."""

    merge_size: int
    hidden_size: int
    accepted_encoder_ids: frozenset[str]


def tokens_for_grid(grid_thw: npt.ArrayLike, merge_size: int) -> int:
    """Embedding rows (= prompt pad tokens) that a [n, 3] grid stands for."""
    return sum(math.prod(row) for row in np.asarray(grid_thw).reshape(-1, 3).tolist()) // (merge_size**2)


def _all_finite(embeds: Array, dtype: str) -> bool:
    # In numpy: torch splits a reduction over its OpenMP threads, and on a busy machine waking them
    # costs milliseconds, far more than the work itself (measured under load: 8-12 ms against
    # 0.3 ms for a 0.8 MB float32 blob). float32: a sum is finite only if every element is, and
    # one reduction is several times faster than isfinite() over megabytes; the exact check runs
    # only when the sum is inf/NaN (or overflowed). 16-bit floats (numpy sums them slowly, or not
    # at all for bfloat16): the exponent bits are checked.
    if embeds.size == 0:
        return True
    exponent = _EXPONENT_BITS.get(dtype)
    if exponent is not None:
        return int((embeds.view(np.uint16) & exponent).max()) != exponent
    flat = embeds.reshape(-1)
    with np.errstate(all="ignore"):  # an overflowing sum is expected, and answered below
        # einsum's plain SIMD sum is twice as fast as sum()'s pairwise one; only finiteness matters.
        return bool(np.isfinite(np.einsum("i->", flat))) or bool(np.isfinite(flat).all())


def _check_dtype(blob: EmbeddingBlob, where: str, param: str | None) -> np.dtype[Any]:
    """The array dtype `blob.dtype` is held in, once both are known to agree."""
    expected = EMBED_ARRAYS.get(blob.dtype)
    if expected is None:
        raise InvalidEmbedding(f"{where} dtype {clip(blob.dtype)} is not one of {sorted(EMBED_ARRAYS)}", param=param)
    if blob.embeds.dtype != expected:
        raise InvalidEmbedding(
            f"{where} dtype {blob.dtype} is held as {expected}, but the array is {blob.embeds.dtype}", param=param
        )
    return expected


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
    _check_dtype(blob, where, param=where)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] < 1 or grid.dtype != np.int64:
        raise InvalidEmbedding(
            f"{where} grid_thw must be int64 [n, 3], got {grid.dtype} {list(grid.shape)}", param=where
        )
    # The grid is a few numbers: Python arithmetic on one tolist() beats several tiny numpy ops.
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
    if not _all_finite(embeds, blob.dtype):
        raise InvalidEmbedding(f"{where} contains NaN or infinite values", param=where)


def encode_blob(blob: EmbeddingBlob, rules: BlobRules) -> bytes:
    """Validates and serializes a blob to safetensors bytes."""
    validate_blob(blob, rules)
    return serialize_unvalidated(blob)


def serialize_unvalidated(blob: EmbeddingBlob) -> bytes:
    """Serializes without checking: only for forwarding client tensors to a service that
    validates them on read (the gateway does not know each model's rules)."""
    _check_dtype(blob, "embedding", param=None)
    grid_dtype = _SAFETENSORS_NAMES.get(str(blob.grid_thw.dtype))  # the reader refuses all but int64
    if grid_dtype is None:
        raise InvalidEmbedding(f"embedding grid_thw of dtype {blob.grid_thw.dtype} cannot be stored")
    prefix = blob.modality
    tensors = {
        f"{prefix}_embeds": (_SAFETENSORS_NAMES[blob.dtype], blob.embeds),
        f"{prefix}_grid_thw": (grid_dtype, blob.grid_thw),
    }
    metadata = {"schema": SCHEMA_VERSION, "encoder_id": blob.encoder_id, "modality": blob.modality, "dtype": blob.dtype}
    return write_safetensors(tensors, metadata)


def write_safetensors(tensors: dict[str, tuple[str, Array]], metadata: dict[str, str]) -> bytes:
    """safetensors bytes of `tensors` (name -> (safetensors dtype, little-endian array)), laid out
    as safetensors itself writes them: tensors with larger elements first (then by name), so each
    starts aligned to its element size, and the JSON header padded with spaces to a multiple of 8.
    Unlike safetensors, the metadata keeps its order: blobs of one shape share their header byte
    for byte, which parse_safetensors_header's cache relies on."""
    ordered = sorted(tensors.items(), key=lambda item: (-item[1][1].dtype.itemsize, item[0]))
    header: dict[str, Any] = {"__metadata__": metadata}
    arrays, offset = [], 0
    for name, (dtype, array) in ordered:
        arrays.append(np.ascontiguousarray(array).data)  # joined below without another copy
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    encoded += b" " * (-len(encoded) % 8)
    return b"".join([struct.pack("<Q", len(encoded)), encoded, *arrays])


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
    except RecursionError:  # a header of nested brackets: json recurses once per level
        raise ValueError("bad header: nested too deeply") from None
    if not isinstance(parsed, dict):
        raise ValueError("bad header: not a JSON object")
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
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            itemsize = _SAFETENSORS_DTYPES[dtype][1].itemsize
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name!r} lacks a known dtype, a shape or two data_offsets") from None
        if not isinstance(shape, list) or not all(type(v) is int and v >= 0 for v in [*shape, begin, end]):
            raise ValueError(f"tensor {name!r} has a bad shape or data_offsets")
        if math.prod(shape) * itemsize != end - begin:
            raise ValueError(f"tensor {name!r}: shape {shape} of {dtype} does not fill bytes {begin}..{end}")
        layout[name] = (dtype, tuple(shape), begin, end)
    position = 0
    for _, _, begin, end in sorted(layout.values(), key=lambda item: item[2]):
        if begin != position:
            raise ValueError("tensor data overlaps or leaves a gap")
        position = end
    if position != data_len:
        raise ValueError(f"tensors cover {position} bytes of {data_len}")
    return layout


def tensor_view(data: bytes, start: int, dtype: np.dtype[Any], shape: tuple[int, ...], begin: int, end: int) -> Array:
    """An array over data[start + begin : start + end], sharing its memory (copied only if misaligned,
    so that torch can take it as it is). safetensors data is little-endian, as `dtype` must say."""
    if begin == end:
        return np.empty(shape, dtype)
    raw = np.frombuffer(data, np.uint8, count=end - begin, offset=start + begin)
    if raw.ctypes.data % dtype.itemsize:
        raw = raw.copy()
    return raw.view(dtype).reshape(shape)


def layout_view(data: bytes, start: int, layout: _Layout) -> tuple[str, Array]:
    """(dtype name, array) of one tensor of a parsed header; see tensor_view and EmbeddingBlob."""
    dtype, shape, begin, end = layout
    name, array_dtype = _SAFETENSORS_DTYPES[dtype]
    return name, tensor_view(data, start, array_dtype, shape, begin, end)


def decode_blob(data: bytes, rules: BlobRules, where: str = "embedding") -> EmbeddingBlob:
    """Parses safetensors bytes into a validated blob; never unpickles anything.

    Zero-copy: the arrays are views of `data`, which they keep alive (see EmbeddingBlob)."""
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
    dtype, embeds_array = layout_view(data, start, embeds)
    _, grid_array = layout_view(data, start, grid)
    blob = EmbeddingBlob(embeds_array, grid_array, metadata.get("encoder_id", ""), modality, dtype)
    validate_blob(blob, rules, where)
    # The metadata says which dtype the array holds (serialize_unvalidated writes the tensor's own);
    # a blob whose two disagree was not written by our codec. Blobs without the entry (clients'
    # hand-made safetensors) are taken at the tensor's word.
    stated = metadata.get("dtype", dtype)
    if stated != dtype:
        raise InvalidEmbedding(f"{where} metadata says dtype {clip(stated)}, but its tensor holds {dtype}", param=where)
    return blob
