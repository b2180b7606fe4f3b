"""The Qwen2-VL vision tower alone, with its image processor: images resampled as transformers'
default (AutoProcessor) processor does (pixels.py), then rescaled, normalised and patched by the
PIL processor, which needs no torchvision.

The encoder pod never needs the language model: only `visual.*` weights are read from the
checkpoint, so a 7B checkpoint costs the encoder a ~600M-parameter tower, not the whole model.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig
from transformers.initialization import no_init_weights
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from encoder_service.batch_invariant import make_batch_invariant
from encoder_service.cuda_graphs import TowerGraphs
from encoder_service.fast_tower import CpuMatmul, make_fast
from encoder_service.pixels import resize_like_autoprocessor, target_size
from encoder_service.resize import check_aspect_ratio
from encoder_service.video import VIDEO_MAX_PIXELS, VIDEO_MIN_PIXELS, checkpoint_frame_bounds
from shared.blob import tokens_for_grid
from shared.encoder_id import is_vision_key, vision_name

# One preprocessed image: pixel_values [patches, C*T*P*P] float32, grid_thw [1, 3] int64.
Preprocessed = tuple[torch.Tensor, torch.Tensor]


def read_vision_state_dict(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Vision-tower tensors of every safetensors shard, names stripped of their layout prefix."""
    state: dict[str, torch.Tensor] = {}
    shards = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {checkpoint_dir}")
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in filter(is_vision_key, f.keys()):
                state[vision_name(key)] = f.get_tensor(key)
    if not state:
        raise ValueError(f"no vision tower weights (prefix visual. or model.visual.) in {checkpoint_dir}")
    return state


def preprocess_image(
    processor: Qwen2VLImageProcessorPil,
    image: Image.Image,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    param: str = "image",
) -> Preprocessed:
    """`image` resized into [min_pixels, max_pixels] (the processor's bounds by default) and patched
    exactly as transformers' default `AutoProcessor` does; (pixel_values, grid_thw [1, 3]).

    The one preprocessing path: the encoder serves with it and model_builders trains with it.
    An image transformers cannot resize is InvalidInput naming `param`; bounds that break
    0 < min <= max are the caller's bug (requests are checked by PixelPolicy first): ValueError.
    """
    low = int(processor.size["shortest_edge"]) if min_pixels is None else min_pixels
    high = int(processor.size["longest_edge"]) if max_pixels is None else max_pixels
    if low <= 0 or high < low:
        raise ValueError(f"need 0 < min_pixels <= max_pixels, got min_pixels={low}, max_pixels={high}")
    check_aspect_ratio(image.width, image.height, param)
    factor = int(processor.patch_size) * int(processor.merge_size)
    height, width = target_size(image.height, image.width, factor, low, high)
    # Resampled as AutoProcessor's default processor does (pixels.py), then only rescaled,
    # normalised and patched by the PIL processor.
    resized = resize_like_autoprocessor(image, height, width)
    out = processor(
        images=[resized], size={"shortest_edge": low, "longest_edge": high}, do_resize=False, return_tensors="pt"
    )
    return out["pixel_values"], out["image_grid_thw"].to(torch.int64)


class VisionEncoder:
    """Preprocesses PIL images and encodes batches of them into LM-space embeddings.

    An image's embeddings are bit-identical whichever images share its batch (see
    batch_invariant.py): stored blobs are keyed by the image. On CPU a float32 tower's linear
    layers run in oneDNN (fast_tower.py), within float rounding of the unmodified tower; with
    cpu_matmul="exact" (and on GPU) they equal what the unmodified tower gives for it alone. A
    bfloat16 tower on a CPU without bfloat16 matmul kernels multiplies in float32, within bfloat16
    rounding of the unmodified one.
    """

    def __init__(
        self,
        tower: Qwen2VisionTransformerPretrainedModel,
        processor: Qwen2VLImageProcessorPil,
        device: torch.device,
        dtype: torch.dtype,
        cpu_matmul: CpuMatmul = "onednn",
        cuda_graphs: int = 0,
        frame_bounds: tuple[int, int] = (VIDEO_MIN_PIXELS, VIDEO_MAX_PIXELS),
    ) -> None:
        # make_fast first: make_batch_invariant runs the forwards it sets once per image.
        self.tower = make_batch_invariant(make_fast(tower, cpu_matmul))
        self.processor = processor
        self.frame_bounds = frame_bounds  # a video frame's default (min_pixels, max_pixels): the checkpoint's
        self.device = device
        self.dtype = dtype
        # GPU towers: up to `cuda_graphs` image shapes replayed as CUDA graphs (cuda_graphs.py).
        self.graphs = TowerGraphs(self.tower, device, cuda_graphs) if device.type == "cuda" and cuda_graphs else None

    @classmethod
    def load(
        cls,
        checkpoint: str,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        cpu_matmul: CpuMatmul = "onednn",
        cuda_graphs: int = 0,
    ) -> VisionEncoder:
        checkpoint_dir = Path(checkpoint)
        vision_config = AutoConfig.from_pretrained(checkpoint_dir).vision_config
        # Weights are overwritten right below; skipping the random init saves seconds on a real tower.
        with no_init_weights():
            tower = Qwen2VisionTransformerPretrainedModel._from_config(vision_config, dtype=dtype)
        tower.load_state_dict(read_vision_state_dict(checkpoint_dir), strict=True)
        # The device only: the parameters already have `dtype`, and a dtype cast would also round
        # the float32 buffers transformers keeps (the rotary inverse frequencies) to bfloat16,
        # moving bfloat16 embeddings up to 0.04 away from transformers' (measured on an H200).
        tower.to(device=device).eval()
        processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint_dir)
        if processor.merge_size != vision_config.spatial_merge_size:
            raise ValueError(
                f"image processor merge_size {processor.merge_size} != "
                f"vision spatial_merge_size {vision_config.spatial_merge_size} in {checkpoint_dir}"
            )
        frame_bounds = checkpoint_frame_bounds(checkpoint_dir)
        return cls(tower, processor, torch.device(device), dtype, cpu_matmul, cuda_graphs, frame_bounds)

    @property
    def merge_size(self) -> int:
        return int(self.tower.config.spatial_merge_size)

    @property
    def hidden_size(self) -> int:
        """Width of one output row: the merger's output, which is the language model's hidden size."""
        return int(self.tower.config.hidden_size)

    @property
    def default_min_pixels(self) -> int:
        return int(self.processor.size["shortest_edge"])

    @property
    def default_max_pixels(self) -> int:
        return int(self.processor.size["longest_edge"])

    @property
    def resize_factor(self) -> int:
        """Each resized side is a multiple of this (patch_size * merge_size, 28 for Qwen2-VL)."""
        return int(self.processor.patch_size) * int(self.processor.merge_size)

    @property
    def patch_pixels(self) -> int:
        """Pixels of one patch: an image resized to N pixels is N // patch_pixels patch rows."""
        return int(self.processor.patch_size) ** 2

    def preprocess(
        self,
        image: Image.Image,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        param: str = "image",
    ) -> Preprocessed:
        """Resize into [min_pixels, max_pixels] and patchify; returns (pixel_values, grid_thw [1, 3]).

        An image transformers cannot resize is InvalidInput naming `param`; bounds that break
        0 < min <= max are the caller's bug (requests are checked by PixelPolicy first): ValueError.
        """
        return preprocess_image(self.processor, image, min_pixels, max_pixels, param)

    def warm_up(self, pixels: int) -> None:
        """Encodes one synthetic image of about `pixels` (capped at the default max_pixels), result
        dropped, so the first requests do not pay a fresh process's slower first pass: measured on
        2 CPU cores with the 2B-shaped tower, a fresh encoder's first burst of 4 images took
        1.1-2.6 CPU-seconds more than its next."""
        side = max(1, math.isqrt(min(pixels, self.default_max_pixels)))
        image = Image.new("RGB", (side, side), (127, 127, 127))
        self.encode_batch([self.preprocess(image)])

    def rows_for(self, grid_thw: torch.Tensor) -> int:
        """Embedding rows one item yields, for grid_thw [n, 3] (the blob contract's rule)."""
        return tokens_for_grid(grid_thw.numpy(), self.merge_size)

    def encode_batch(self, items: list[Preprocessed]) -> list[torch.Tensor]:
        """Encode several preprocessed images (or videos): one forward pass, or on a GPU with CUDA
        graphs one graph replay per item (cuda_graphs.py).

        Returns one [rows, hidden_size] tensor per item, on CPU, in the encoder dtype; each is
        bit-identical to `encode_batch([item])[0]`.
        """
        if not items:
            return []
        if self.graphs is not None and self.graphs.enabled:
            return [self._encode_alone(item) for item in items]
        return self._encode_in_one_pass(items)

    def _encode_in_one_pass(self, items: list[Preprocessed]) -> list[torch.Tensor]:
        pixel_values = torch.cat([pv for pv, _ in items]).to(self.device, self.dtype)
        grid_thw = torch.cat([grid.reshape(-1, 3) for _, grid in items]).to(self.device, torch.int64)
        with torch.inference_mode():
            merged = self.tower(pixel_values, grid_thw=grid_thw).pooler_output
        sizes = [self.rows_for(grid) for _, grid in items]
        # clone: each result is stored on its own; a view would keep the whole batch alive.
        return [chunk.to("cpu").clone() for chunk in torch.split(merged, sizes)]

    def _encode_alone(self, item: Preprocessed) -> torch.Tensor:
        """One item in a pass of its own: its grid's CUDA graph, or eagerly where it has none yet."""
        assert self.graphs is not None
        pixel_values, grid_thw = item
        rows = grid_thw.reshape(-1, 3).tolist()
        if len(rows) == 1:
            with torch.inference_mode():
                replayed = self.graphs.encode(pixel_values.to(self.device, self.dtype), tuple(rows[0]))
            if replayed is not None:
                return replayed
        return self._encode_in_one_pass([item])[0]
