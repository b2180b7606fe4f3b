"""The vision tower's torch output as an embedding blob: the one place the encoder leaves torch.

The blob codec (shared/blob.py) works on numpy, so that the gateway never loads torch; the encoder
converts each result once, where its blob is built. No values change: a CPU tensor is shared, not
copied, and bfloat16 (which numpy lacks) keeps its bits.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.blob import EmbeddingBlob, EmbedDtype, Modality

# The blob dtype name of each tower dtype the encoder runs in.
_DTYPE_NAMES: dict[torch.dtype, EmbedDtype] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def blob_dtype(dtype: torch.dtype) -> EmbedDtype:
    """The blob's name of a tower dtype ("bfloat16"); part of every key (shared/keys.py)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # a tower dtype the encoder settings never allow: a bug, not a client error
        raise ValueError(f"the vision tower produced {dtype}; blobs hold float32, float16 or bfloat16")
    return name


def blob_from_tensors(
    embeds: torch.Tensor, grid_thw: torch.Tensor, encoder_id: str, modality: Modality
) -> EmbeddingBlob:
    """embeds [rows, hidden] in the tower's dtype, grid_thw [n, 3] int64, as the blob that stores them."""
    dtype = blob_dtype(embeds.dtype)
    rows = embeds.detach().cpu().contiguous()
    array = rows.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else rows.numpy()
    grid = grid_thw.detach().cpu().to(torch.int64).numpy()
    return EmbeddingBlob(array, grid, encoder_id, modality, dtype)
