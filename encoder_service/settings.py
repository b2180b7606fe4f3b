"""Encoder service settings; every field reads from ENCODER_<NAME>."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from encoder_service.fast_tower import CpuMatmul
from shared.settings import GrpcServerSettings, StoreSettings


class EncoderSettings(StoreSettings, GrpcServerSettings):
    model_config = SettingsConfigDict(env_prefix="ENCODER_", extra="ignore")

    checkpoint: str = Field(..., description="Qwen2-VL checkpoint dir (or hub id) whose vision tower encodes images.")
    encoder_id: str | None = Field(
        None, description="Override of the id derived from the vision weights and processor config."
    )
    device: str = Field("cpu", description="torch device for the vision tower (cpu, cuda, cuda:1).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Vision tower dtype; stored blobs keep it."
    )
    cpu_matmul: CpuMatmul = Field(
        "onednn",
        description="float32 tower on CPU: onednn runs its linear layers in oneDNN's matmul, as vLLM does (measured "
        "25-30% faster a forward pass than torch's default kernels; values within float rounding of "
        "transformers' tower); exact keeps torch's kernels, bit-identical to transformers' get_image_features.",
    )
    cuda_graphs: int = Field(
        8,
        ge=0,
        description="GPU towers: most image shapes kept as CUDA graphs, each replaying a whole pass with one launch "
        "(encoder_service/cuda_graphs.py; a shape is captured the second time it is seen); results are the eager "
        "pass's bits. 0 = eager only. Ignored on CPU.",
    )
    max_image_bytes: int = Field(
        20 * 1024 * 1024, gt=0, description="Largest image file accepted (bytes or fetched URL)."
    )
    max_decoded_pixels: int = Field(
        64_000_000, gt=0, description="Largest width*height decoded; refuses decompression bombs."
    )
    max_pixels_limit: int | None = Field(
        None,
        gt=0,
        description="Highest max_pixels (or min_pixels) a request may ask for; unset = the checkpoint image "
        "processor's max_pixels, so clients may lower an image's resolution but not raise it.",
    )
    fetch_timeout_s: float = Field(10.0, gt=0, description="Timeout for fetching an http(s) image URL.")
    allow_private_urls: bool = Field(
        False, description="Allow fetching from private, loopback and link-local addresses."
    )
    url_schemes: list[str] = Field(["http", "https"], description="Schemes an image URL may use (JSON list).")
    url_allowed_domains: list[str] = Field(
        default_factory=list,
        description="Hosts (and their subdomains) images may be fetched from (JSON list); empty = any.",
    )
    max_video_frames: int = Field(64, ge=1, description="Most frames in one video.")
    max_video_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="Most bytes of image files one video's frames hold together, sent or fetched (a fetch is "
        "charged as its bytes arrive), so a video of URLs cannot hold max_video_frames x max_image_bytes.",
    )
    video_min_pixels: int | None = Field(
        None,
        gt=0,
        description="Default lower bound on a video frame's resized pixel count; unset = the checkpoint's, as "
        "transformers' AutoProcessor and vLLM take it (its video processor config, else its image processor's).",
    )
    video_max_pixels: int | None = Field(
        None,
        gt=0,
        description="Default upper bound on a video frame's resized pixel count; unset = the checkpoint's, as "
        "for video_min_pixels.",
    )
    video_max_pixels_limit: int | None = Field(
        None,
        gt=0,
        description="Highest per-frame max_pixels (or min_pixels) a video request may ask for; unset = the "
        "default upper bound (video_max_pixels).",
    )
    max_video_total_pixels: int = Field(
        64 * 768 * 28 * 28,
        gt=0,
        description="Most pixels one video's frames hold together once resized (frames x each frame's resized "
        "size); the default is 64 frames at 768x28x28 (qwen-vl-utils' per-frame cap).",
    )
    max_batch_size: int = Field(8, ge=1, description="Most images in one vision-tower forward pass.")
    batch_wait_ms: float = Field(5.0, ge=0, description="How long the first image of a batch waits for others.")
    retain_freed_memory: bool = Field(
        True,
        description="Keep memory the vision tower frees in the process (glibc: no mmap for large blocks, no "
        "trimming) instead of page-faulting it back on every forward pass; the process keeps its peak heap.",
    )
    warmup_pixels: int = Field(
        448 * 448,
        ge=0,
        description="Pixels of a synthetic image encoded once before serving, so the first requests do not pay "
        "the forward pass's one-time set-up; capped at the processor's max_pixels; 0 = no warm-up.",
    )
    batch_hold_ms: float = Field(
        500.0, ge=0, description="Longest a batch waits for images already being decoded by concurrent calls."
    )
