"""A video, given as its frames, preprocessed the way Qwen2-VL's video processor does it.

transformers' `Qwen2VLVideoProcessor` needs torchvision; the encoder must not (DESIGN.md). So each
frame is resized as an image is (pixels.py), rescaled and normalised by the same PIL image processor, and the
frames are then regrouped into temporal patches: Qwen2-VL's patch embedding sees
`temporal_patch_size` (2) consecutive frames as one patch, so a video of F frames has
t = ceil(F / 2) temporal positions, with an odd last frame repeated, as transformers does.
A video of two identical frames therefore has exactly the pixel values of that image.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoder_service.pixels import resize_like_autoprocessor, target_size
from encoder_service.resize import check_aspect_ratio
from shared.errors import InvalidInput

# Per-frame pixel bounds of transformers' Qwen2VLVideoProcessor and of qwen-vl-utils: a frame gets
# far fewer pixels than an image by default, since a video has many of them.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


def check_frame_size(frame: Image.Image, index: int, first: tuple[int, int]) -> None:
    """A frame must have the first frame's size (one grid covers the whole video), and a shape
    transformers can resize."""
    check_aspect_ratio(frame.width, frame.height, f"frames[{index}]")
    if frame.size != first:
        raise InvalidInput(
            f"video frames must all have one size: frame 0 is {first[0]}x{first[1]}, "
            f"frame {index} is {frame.size[0]}x{frame.size[1]}",
            param=f"frames[{index}]",
        )


def resized_frames(frames: Iterable[Image.Image], factor: int, min_pixels: int, max_pixels: int) -> list[Image.Image]:
    """Each frame checked and resized as it comes, so only one is ever held at its decoded size:
    a video may have ENCODER_MAX_VIDEO_FRAMES frames of ENCODER_MAX_DECODED_PIXELS each, and
    holding them all decoded (a 64-frame request of a few MB could ask for 12 GB) is what the
    decoded-pixel limit exists to prevent."""
    resized: list[Image.Image] = []
    first, target = (0, 0), (0, 0)
    for index, frame in enumerate(frames):
        if index == 0:
            first = frame.size
        check_frame_size(frame, index, first)  # before smart_resize, which raises ValueError on a bad shape
        if index == 0:
            target = target_size(frame.height, frame.width, factor, min_pixels, max_pixels)
        resized.append(resize_like_autoprocessor(frame, *target))  # as for images
        del frame  # the decoded frame goes before the next one is decoded
    if not resized:
        raise InvalidInput("a video needs at least one frame", param="frames")
    return resized


def preprocess_video(
    processor: Qwen2VLImageProcessorPil, frames: Iterable[Image.Image], min_pixels: int, max_pixels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (pixel_values [t*h*w, C*T*P*P] float32, grid_thw [1, 3] int64) for frames of one size.
    `frames` may be a generator that decodes each frame when asked: it is consumed one frame at a time."""
    factor = processor.patch_size * processor.merge_size
    resized = resized_frames(frames, factor, min_pixels, max_pixels)
    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    out = processor(images=resized, size=size, do_resize=False, return_tensors="pt")
    grids = out["image_grid_thw"]
    _, grid_h, grid_w = (int(v) for v in grids[0])
    channels, temporal, patch = 3, processor.temporal_patch_size, processor.patch_size
    # The image processor repeats each frame over the temporal axis; keep one copy per frame.
    # Per patch the layout is (C, T, P, P); patches run in the merge-window order of both processors.
    per_frame = out["pixel_values"].reshape(len(resized), grid_h * grid_w, channels, temporal, patch, patch)[:, :, :, 0]
    if pad := -len(resized) % temporal:
        per_frame = torch.cat([per_frame, per_frame[-1:].expand(pad, -1, -1, -1, -1)])
    grid_t = per_frame.shape[0] // temporal
    # [t*T, S, C, P, P] -> [t, T, S, C, P, P] -> [t, S, C, T, P, P]: frames of one temporal patch side by side.
    grouped = per_frame.reshape(grid_t, temporal, grid_h * grid_w, channels, patch, patch).permute(0, 2, 3, 1, 4, 5)
    pixel_values = grouped.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch).contiguous()
    return pixel_values, torch.tensor([[grid_t, grid_h, grid_w]], dtype=torch.int64)
