"""An embedding blob's arrays as the torch tensors an engine takes.

The one place the LLM service turns a decoded blob into torch: the blob codec (shared/blob.py) is
kept free of torch so that the gateway, which only checks blobs, never loads it.
"""

from __future__ import annotations

import torch

from shared.blob import EmbeddingBlob


def embeds_tensor(blob: EmbeddingBlob) -> torch.Tensor:
    """[rows, hidden] in the blob's dtype, sharing the blob's memory (read it, never write it)."""
    return blob.embeds


def grid_tensor(blob: EmbeddingBlob) -> torch.Tensor:
    """[n, 3] int64."""
    return blob.grid_thw
