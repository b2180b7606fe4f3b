"""Inline image (or video) embeddings in vLLM's form: base64 of `.npy` or safetensors bytes.

A `torch.save` payload is a pickle; it is refused, never loaded: unpickling
client bytes runs client code.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import struct
import tokenize

import numpy as np

from shared.blob import (
    Array,
    EmbeddingBlob,
    Modality,
    layout_view,
    parse_safetensors_header,
    serialize_unvalidated,
    split_safetensors_header,
    tensor_view,
)
from shared.errors import InvalidEmbedding, InvalidInput, clip

NPY_MAGIC = b"\x93NUMPY"
# Little-endian, as blobs store it; the data is taken as it lies.
NPY_DTYPES = {np.dtype("<f4"): "float32", np.dtype("<f2"): "float16"}
SAFE_FORMATS = "send the tensor as .npy bytes (numpy.save) or safetensors bytes, base64-encoded"


def _looks_like_safetensors(raw: bytes) -> bool:
    if len(raw) < 10:
        return False
    (header_len,) = struct.unpack("<Q", raw[:8])
    return header_len <= len(raw) - 8 and raw[8:9] == b"{"


def _npy_header(stream: io.BytesIO, name: str, param: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of a .npy header, read by numpy's own parsers, which never
    unpickle and refuse a header over their size cap: a hostile header length reads no further
    than the payload already in memory."""
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(stream)
        if version == (2, 0):
            return np.lib.format.read_array_header_2_0(stream)
    # numpy tokenizes the header and literal-evals it: a mangled one fails in any of these ways.
    except (ValueError, SyntaxError, tokenize.TokenError, TypeError, RecursionError) as error:
        raise InvalidInput(f"{name} .npy header is unreadable: {clip(str(error))}", param=param) from None
    raise InvalidInput(f"{name} .npy format version {version} is not supported (1.0 or 2.0)", param=param)


def _from_npy(raw: bytes, name: str, param: str) -> tuple[str, Array]:
    """(dtype, the [tokens, hidden] array the header describes), checked against the bytes present before
    anything is allocated (np.load allocates whatever shape a header claims, then fails to fill
    it), and a view of `raw` when in C order."""
    stream = io.BytesIO(raw)
    shape, fortran_order, dtype = _npy_header(stream, name, param)
    if dtype not in NPY_DTYPES:
        raise InvalidInput(f"{name} .npy dtype {dtype.str} is not float32 or float16 (little-endian)", param=param)
    if len(shape) != 2 or min(shape) < 0:
        raise InvalidInput(f"{name} .npy array must be 2-D [tokens, hidden], got shape {list(shape)}", param=param)
    present = len(raw) - stream.tell()
    if math.prod(shape) * dtype.itemsize != present:
        raise InvalidInput(
            f"{name} .npy header declares shape {list(shape)} of {dtype.str}, which does not match the "
            f"{present} data bytes present",
            param=param,
        )
    if fortran_order:  # the transpose, stored row by row; one copy makes it [tokens, hidden] in C order
        array = np.ascontiguousarray(tensor_view(raw, stream.tell(), dtype, shape[::-1], 0, present).T)
    else:
        array = tensor_view(raw, stream.tell(), dtype, shape, 0, present)
    return NPY_DTYPES[dtype], array


def _from_safetensors(raw: bytes, name: str, param: str) -> tuple[str, Array]:
    """(dtype, the tensor named `name`, or the only one), a view of `raw`. The header is checked
    against the payload as stored blobs are (shared.blob): declared sizes must fill the data
    exactly, so nothing larger than the payload is ever allocated."""
    try:
        header, start = split_safetensors_header(raw, param)
        _, layout = parse_safetensors_header(header, len(raw) - start)
    except (InvalidEmbedding, ValueError):  # the parser maps every malformed header to these
        raise InvalidInput(f"{name} safetensors payload is not valid", param=param) from None
    if name in layout:
        return layout_view(raw, start, layout[name])
    if len(layout) != 1:
        raise InvalidInput(f"{name} safetensors payload must hold one tensor (or one named {name})", param=param)
    return layout_view(raw, start, next(iter(layout.values())))


def decode_inline_tensor(encoded: str, param: str, modality: Modality = "image") -> tuple[str, Array]:
    """(dtype, the [tokens, hidden] array) inside a base64 `.npy` or safetensors payload; a
    bfloat16 array is held as its bits (see shared.blob)."""
    name = f"{modality}_embeds"
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput(f"{name} is not valid base64", param=param) from None
    if raw.startswith(NPY_MAGIC):
        return _from_npy(raw, name, param)
    if _looks_like_safetensors(raw):
        return _from_safetensors(raw, name, param)
    if raw[:2] == b"PK" or raw[:1] == b"\x80":
        raise InvalidInput(
            f"{name} looks like a torch.save/pickle payload, which is never loaded; {SAFE_FORMATS}", param=param
        )
    raise InvalidInput(f"{name} format not recognized; {SAFE_FORMATS}", param=param)


def inline_blob(encoded: str, grid_thw: list[int], encoder_id: str, param: str, modality: Modality = "image") -> bytes:
    """A blob for the LLM service, which validates it like a stored one."""
    dtype, embeds = decode_inline_tensor(encoded, param, modality)
    grid = np.array([grid_thw], dtype=np.int64)
    return serialize_unvalidated(EmbeddingBlob(embeds, grid, encoder_id, modality, dtype))
