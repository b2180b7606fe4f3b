"""FLOPs of one Qwen2-VL vision-tower forward pass, counted from the tower's shapes.

A multiply-add is 2 FLOPs. Counted: the matrix products, which are what a GPU's bf16 peak is
quoted for: the patch embedding (a Conv3d over each patch), in each block the qkv projection, the
attention scores and the weighted values, the output projection and the two MLP layers, and the
merger's two layers. Not counted: norms, activations, softmax and the rotary tables (well under 1%
at 448x448). The tower attends within each frame of each image (cu_seqlens), so attention grows
with the square of a frame's patches, not of the batch's. tests/test_gpu_bench.py checks this
count against torch's own FlopCounterMode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def tower_flops(vision_config: Any, grids: Iterable[tuple[int, int, int]]) -> int:
    """FLOPs to encode images of these (t, h, w) patch grids (one forward pass or several: the
    count is the same, since nothing is shared between images)."""
    embed = int(vision_config.embed_dim)
    mlp = int(embed * vision_config.mlp_ratio)
    merge = int(vision_config.spatial_merge_size)
    patch_in = (
        int(vision_config.in_channels) * int(vision_config.temporal_patch_size) * int(vision_config.patch_size) ** 2
    )
    merger_in = embed * merge**2
    total = 0
    for t, h, w in grids:
        patches = t * h * w
        block = (
            2 * patches * embed * 3 * embed  # qkv
            + 2 * 2 * t * (h * w) ** 2 * embed  # scores and values, each frame attending to itself
            + 2 * patches * embed * embed  # output projection
            + 2 * 2 * patches * embed * mlp  # fc1, fc2
        )
        merged = patches // merge**2
        merger = 2 * merged * merger_in * merger_in + 2 * merged * merger_in * int(vision_config.hidden_size)
        total += 2 * patches * patch_in * embed + int(vision_config.depth) * block + merger
    return total


def utilisation(flops_per_image: int, images_per_s: float, peak_flops: float) -> float:
    """Fraction of the device's peak that `images_per_s` images of this cost amount to."""
    return flops_per_image * images_per_s / peak_flops
