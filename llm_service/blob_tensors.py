"""An embedding blob's arrays as the torch tensors an engine takes.

The one place the LLM service turns a decoded blob into torch: the blob codec (shared/blob.py) is
kept free of torch so that the gateway, which only checks blobs, never loads it. No copy is made:
the tensors share the blob's memory, which is the fetched bytes themselves.
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from shared.blob import EmbeddingBlob


@functools.cache
def _absorb_read_only_warning() -> None:
    """A decoded blob's arrays are read-only views of the fetched bytes, which cannot be made
    writable without the copy we avoid; torch warns once per process that it cannot mark a tensor
    read-only. The tensors are only ever read (engines copy them with cat), so that one warning is
    taken here, silenced, before the first real conversion."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


def embeds_tensor(blob: EmbeddingBlob) -> torch.Tensor:
    """[rows, hidden] in the blob's dtype, sharing the blob's memory (read it, never write it)."""
    _absorb_read_only_warning()
    if blob.dtype == "bfloat16":  # held as its bits (numpy has no bfloat16): reinterpreted, not converted
        return torch.from_numpy(blob.embeds.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(blob.embeds)


def grid_tensor(blob: EmbeddingBlob) -> torch.Tensor:
    """[n, 3] int64."""
    _absorb_read_only_warning()
    return torch.from_numpy(blob.grid_thw)
