"""Batch-invariant forward passes of the Qwen2-VL vision tower.

Why: an image's embeddings are stored under a key derived from the image alone, so the stored
values must not depend on which other images shared its forward pass. The stock tower does not
promise that. It concatenates the patches of every image into one [patches, dim] matrix, and:
- the CPU GEMM libraries (MKL, oneDNN) pick their blocking, and so the order in which each
  output's products are summed, from the row count M of the whole matrix: the same image gives
  results ~1e-5 apart alone and in a batch (float32, values of std ~8);
- element-wise kernels over a flattened tensor run full SIMD vectors, then a scalar tail whose
  transcendental functions (the MLPs' GELU, the rotary cos/sin) may round differently; where
  the tails and the per-thread chunks fall depends on the total element count and the thread
  count. With per-image GEMMs alone, images still differed with 3, 5, 7 or 16 threads (not 1
  or 2) until the whole MLPs ran per image. The rotary tables never differed in our runs; they
  are computed per image on the same grounds, at no measurable cost.
Attention is already computed per image (transformers splits it by `cu_seqlens`); row-wise ops
(LayerNorm) and exactly rounded element-wise ops (add, multiply, dtype casts) give the same bits
wherever a row sits.

So every shape-sensitive submodule runs once per image on exactly the rows that image has alone:
the patch embedding, the rotary tables, each block's qkv and output projections and its MLP, and
the merger. The batch still makes one call of the tower; what it shares is the row-wise work, and
each image's result is bit-identical to encoding it alone with the unmodified tower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any, cast

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel, Qwen2VLVisionBlock

# Patch rows of each image in the running forward pass; None outside one. A ContextVar rather
# than an attribute: two threads may run forward passes of one tower at the same time.
_IMAGE_ROWS: ContextVar[tuple[int, ...] | None] = ContextVar("image_rows", default=None)
_MARK = "_batch_invariant"


def make_batch_invariant(tower: Qwen2VisionTransformerPretrainedModel) -> Qwen2VisionTransformerPretrainedModel:
    """Patches `tower` in place (idempotent) and returns it.

    Only this instance's submodules get a new `forward`; classes, weights and state-dict names
    stay as they are, and with one image per call every patched submodule runs exactly as before.
    """
    if getattr(tower, _MARK, False):
        return tower
    for module in _shape_sensitive_modules(tower):
        module.forward = _per_image(module.forward)
    tower.forward = _tracking_image_rows(tower.forward)
    setattr(tower, _MARK, True)
    return tower


def _shape_sensitive_modules(tower: Qwen2VisionTransformerPretrainedModel) -> Iterator[nn.Module]:
    """Submodules whose input is [patches, ...] rows and whose output rows depend on the row count."""
    yield tower.patch_embed  # Conv3d, a GEMM over flattened patches
    yield tower.rotary_pos_emb  # cos/sin over [patches, 2] positions
    for block in cast(Iterable[Qwen2VLVisionBlock], tower.blocks):  # a ModuleList of them
        yield block.attn.qkv
        yield block.attn.proj
        yield block.mlp  # fc1, activation, fc2
    yield tower.merger  # its 2x2 groups of rows never straddle two images


def _tracking_image_rows(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        # One row of grid_thw is one image (or video) and owns prod(t, h, w) patch rows.
        rows = tuple(int(n) for n in grid_thw.prod(dim=-1).tolist())
        token = _IMAGE_ROWS.set(rows)
        try:
            return forward(hidden_states, grid_thw=grid_thw, **kwargs)
        finally:
            _IMAGE_ROWS.reset(token)

    return run


def _per_image(forward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any) -> Any:
        rows = _IMAGE_ROWS.get()
        if rows is None or len(rows) == 1:
            return forward(*args)
        columns = [_split_rows(arg, rows) for arg in args]
        outputs = [forward(*(column[i] for column in columns)) for i in range(len(rows))]
        return _concat(outputs)

    return run


def _split_rows(arg: Any, rows: tuple[int, ...]) -> Sequence[Any]:
    """A tensor with one row per patch, cut per image; any other argument, whole for every image."""
    if isinstance(arg, torch.Tensor) and arg.shape[0] == sum(rows):
        return torch.split(arg, list(rows))
    return [arg] * len(rows)


def _concat(outputs: list[Any]) -> Any:
    """Per-image outputs back into one batch: a tensor, or a tuple of tensors (cos, sin)."""
    if isinstance(outputs[0], torch.Tensor):
        return torch.cat(outputs)
    return tuple(torch.cat(parts) for parts in zip(*outputs, strict=True))
