"""A video, given as its frames, preprocessed the way Qwen2-VL's video processor does it.

transformers' `Qwen2VLVideoProcessor` needs torchvision; the encoder must not (DESIGN.md). So each
frame is resized as an image is (pixels.py), rescaled and normalised by the same PIL image processor, and the
frames are then regrouped into temporal patches: Qwen2-VL's patch embedding sees
`temporal_patch_size` (2) consecutive frames as one patch, so a video of F frames has
t = ceil(F / 2) temporal positions, with an odd last frame repeated, as transformers does.
A video of two identical frames therefore has exactly the pixel values of that image.

Frames are resized within the bounds transformers' AutoProcessor (and vLLM) use for the checkpoint
(`checkpoint_frame_bounds`), so a video gets the pixels, grid and answer it gets there.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.video_processing_utils import BaseVideoProcessor

from encoder_service.pixels import resize_like_autoprocessor, target_size
from encoder_service.resize import check_aspect_ratio
from shared.errors import InvalidInput

# Per-frame pixel bounds of transformers' Qwen2VLVideoProcessor class (and of qwen-vl-utils): what
# a checkpoint whose processor config names no bounds gets.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


def checkpoint_frame_bounds(checkpoint_dir: Path) -> tuple[int, int]:
    """The (min_pixels, max_pixels) each frame of a video is resized within by transformers'
    AutoProcessor for this checkpoint, and by vLLM: its video_preprocessor_config.json, or, where
    it has none (Qwen2-VL's published checkpoints have none), its preprocessor_config.json, which
    transformers falls back to, so frames get the image bounds; `min_pixels` / `max_pixels` there
    override `size`, as Qwen2VLVideoProcessor reads them. transformers' own loader finds the file
    (the video processor class itself needs torchvision, which the encoder does not have)."""
    config, _ = BaseVideoProcessor.get_video_processor_dict(str(checkpoint_dir))
    size = config.get("size") or {}
    low = config.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or VIDEO_MIN_PIXELS
    high = config.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or VIDEO_MAX_PIXELS
    return int(low), int(high)


def check_total_pixels(target: tuple[int, int], frame_count: int, max_total_pixels: int) -> None:
    """A video's frames, resized to `target` (height, width) each, may hold at most
    `max_total_pixels` together (0: no limit). The tower's work grows with them, and the per-frame
    bounds alone do not bound it: under a real checkpoint's (Qwen2-VL's: up to 12.8 M pixels a
    frame) a few dozen frames of a few KB each would cost the encoder minutes and gigabytes."""
    total = target[0] * target[1] * frame_count
    if max_total_pixels and total > max_total_pixels:
        raise InvalidInput(
            f"the video's {frame_count} frames, resized to {target[1]}x{target[0]} pixels each, hold {total} "
            f"pixels; the limit is {max_total_pixels} per video: send fewer or smaller frames, or lower max_pixels",
            param="frames",
        )


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


def resized_frames(
    frames: Iterable[Image.Image],
    factor: int,
    min_pixels: int,
    max_pixels: int,
    frame_count: int = 0,
    max_total_pixels: int = 0,
) -> list[Image.Image]:
    """Each frame checked and resized as it comes, so only one is ever held at its decoded size:
    a video may have ENCODER_MAX_VIDEO_FRAMES frames of ENCODER_MAX_DECODED_PIXELS each, and
    holding them all decoded (a 64-frame request of a few MB could ask for 12 GB) is what the
    decoded-pixel limit exists to prevent. The first frame's resized size settles the video's
    total (`frame_count` frames, check_total_pixels) before any other frame is decoded."""
    resized: list[Image.Image] = []
    first, target = (0, 0), (0, 0)
    for index, frame in enumerate(frames):
        if index == 0:
            first = frame.size
        check_frame_size(frame, index, first)  # before smart_resize, which raises ValueError on a bad shape
        if index == 0:
            target = target_size(frame.height, frame.width, factor, min_pixels, max_pixels)
            check_total_pixels(target, frame_count, max_total_pixels)
        resized.append(resize_like_autoprocessor(frame, *target))  # as for images
        del frame  # the decoded frame goes before the next one is decoded
    if not resized:
        raise InvalidInput("a video needs at least one frame", param="frames")
    return resized


def preprocess_video(
    processor: Qwen2VLImageProcessorPil,
    frames: Iterable[Image.Image],
    min_pixels: int,
    max_pixels: int,
    frame_count: int = 0,
    max_total_pixels: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (pixel_values [t*h*w, C*T*P*P] float32, grid_thw [1, 3] int64) for frames of one size.
    `frames` may be a generator that decodes each frame when asked: it is consumed one frame at a
    time. `frame_count` frames may hold `max_total_pixels` once resized (0: no limit)."""
    factor = processor.patch_size * processor.merge_size
    resized = resized_frames(frames, factor, min_pixels, max_pixels, frame_count, max_total_pixels)
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
