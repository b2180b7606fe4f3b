"""Inline image (or video) embeddings in vLLM's form: base64 of `.npy` or safetensors bytes.

A `torch.save` payload is a pickle; it is refused, never loaded: unpickling
client bytes runs client code.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors

from shared.blob import EmbeddingBlob, Modality, serialize_unvalidated
from shared.errors import InvalidInput

NPY_MAGIC = b"\x93NUMPY"
SAFE_FORMATS = "send the tensor as .npy bytes (numpy.save) or safetensors bytes, base64-encoded"


def _looks_like_safetensors(raw: bytes) -> bool:
    if len(raw) < 10:
        return False
    (header_len,) = struct.unpack("<Q", raw[:8])
    return header_len <= len(raw) - 8 and raw[8:9] == b"{"


def _from_npy(raw: bytes, name: str, param: str) -> torch.Tensor:
    try:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
    except ValueError as error:
        raise InvalidInput(f"{name} .npy payload is unreadable or holds objects: {error}", param=param) from None
    if array.dtype not in (np.float32, np.float16):
        raise InvalidInput(f"{name} .npy dtype {array.dtype} is not float32 or float16", param=param)
    return torch.from_numpy(np.ascontiguousarray(array))


def _from_safetensors(raw: bytes, name: str, param: str) -> torch.Tensor:
    try:
        tensors = load_safetensors(raw)
    except (SafetensorError, json.JSONDecodeError):
        raise InvalidInput(f"{name} safetensors payload is not valid", param=param) from None
    if name in tensors:
        return tensors[name]
    if len(tensors) != 1:
        raise InvalidInput(f"{name} safetensors payload must hold one tensor (or one named {name})", param=param)
    return next(iter(tensors.values()))


def decode_inline_tensor(encoded: str, param: str, modality: Modality = "image") -> torch.Tensor:
    """The [tokens, hidden] tensor inside a base64 `.npy` or safetensors payload."""
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
    embeds = decode_inline_tensor(encoded, param, modality)
    grid = torch.tensor([grid_thw], dtype=torch.int64)
    return serialize_unvalidated(EmbeddingBlob(embeds, grid, encoder_id, modality))
