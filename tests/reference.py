"""Independent greedy reference: transformers' own pieces only, none of our product code.

The prompt is rendered by the checkpoint's chat template, the image goes through
Qwen2VLImageProcessorPil, and the full model encodes `pixel_values` itself inside `generate`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

_MODELS: dict[Path, Qwen2VLForConditionalGeneration] = {}


def _model(checkpoint: Path) -> Qwen2VLForConditionalGeneration:
    # Cached: golden tests ask the same checkpoint many questions.
    key = Path(checkpoint).resolve()
    if key not in _MODELS:
        _MODELS[key] = Qwen2VLForConditionalGeneration.from_pretrained(key, dtype=torch.float32).eval()
    return _MODELS[key]


def reference_greedy_tokens(checkpoint: Path, image: Image.Image, question: str, max_new_tokens: int) -> list[int]:
    """Greedy completion token ids (eos included when produced) for one image and one question."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    model = _model(checkpoint)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vision = processor(images=[image], return_tensors="pt")
    merge = model.config.vision_config.spatial_merge_size
    n_rows = int(vision["image_grid_thw"].prod()) // merge**2
    image_pad = "<|image_pad|>"
    assert text.count(image_pad) == 1, text
    text = text.replace(image_pad, image_pad * n_rows)
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    mm_token_type_ids = (input_ids == model.config.image_token_id).long()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=vision["pixel_values"],
            image_grid_thw=vision["image_grid_thw"],
            mm_token_type_ids=mm_token_type_ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, input_ids.shape[1] :].tolist()


def reference_video_greedy_tokens(
    checkpoint: Path, frames: list[Image.Image], question: str, max_new_tokens: int
) -> list[int]:
    """Greedy completion token ids for one video (its frames) and one question.

    The frames go through transformers' own Qwen2VLVideoProcessor (it needs torchvision, which the
    test environment provides) without resizing: callers pass frames already at the size the
    encoder's defaults keep, so both sides see the same pixels.
    """
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = _model(checkpoint)
    video = torch.stack([torch.from_numpy(np.array(frame)).permute(2, 0, 1) for frame in frames])
    vision = Qwen2VLVideoProcessor()(videos=[video], do_resize=False, do_sample_frames=False, return_tensors="pt")
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    merge = model.config.vision_config.spatial_merge_size
    n_rows = int(vision["video_grid_thw"].prod()) // merge**2
    video_pad = "<|video_pad|>"
    assert text.count(video_pad) == 1, text
    input_ids = tokenizer(text.replace(video_pad, video_pad * n_rows), add_special_tokens=False, return_tensors="pt")[
        "input_ids"
    ]
    mm_token_type_ids = (input_ids == model.config.video_token_id).long() * 2  # 2 = video
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values_videos=vision["pixel_values_videos"],
            video_grid_thw=vision["video_grid_thw"],
            mm_token_type_ids=mm_token_type_ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
        )
    return out[0, input_ids.shape[1] :].tolist()
