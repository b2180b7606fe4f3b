"""Independent greedy reference: transformers' own pieces only, none of our product code.

The prompt is rendered by the checkpoint's chat template, an image goes through transformers'
default image processor (`AutoImageProcessor`, as AutoProcessor picks it: the torchvision-backed
Qwen2VLImageProcessor), a video through Qwen2VLVideoProcessor, and the full model encodes the
pixels itself inside `generate`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLForConditionalGeneration

_MODELS: dict[Path, Qwen2VLForConditionalGeneration] = {}


def _model(checkpoint: Path) -> Qwen2VLForConditionalGeneration:
    # Cached: golden tests ask the same checkpoint many questions.
    key = Path(checkpoint).resolve()
    if key not in _MODELS:
        _MODELS[key] = Qwen2VLForConditionalGeneration.from_pretrained(key, dtype=torch.float32).eval()
    return _MODELS[key]


def reference_greedy_tokens(checkpoint: Path, image: Image.Image, question: str, max_new_tokens: int) -> list[int]:
    """Greedy completion token ids (eos included when produced) for one image and one question."""
    processor = AutoImageProcessor.from_pretrained(checkpoint)
    assert type(processor).__name__ == "Qwen2VLImageProcessor", f"not transformers' default: {type(processor)}"
    vision = processor(images=[image], return_tensors="pt")
    return _greedy_with_pixels(checkpoint, "image", question, max_new_tokens, dict(vision))


def reference_video_greedy_tokens(
    checkpoint: Path, frames: list[Image.Image], question: str, max_new_tokens: int
) -> list[int]:
    """Greedy completion token ids for one video (its frames) and one question.

    The frames go through the video processor `AutoProcessor` loads for the checkpoint, with its
    defaults (it resizes them; it needs torchvision, which the test environment provides), every
    frame as given (no sampling).
    """
    from transformers import AutoVideoProcessor

    video = torch.stack([torch.from_numpy(np.array(frame)).permute(2, 0, 1) for frame in frames])
    processor = AutoVideoProcessor.from_pretrained(checkpoint)
    vision = processor(videos=[video], do_sample_frames=False, return_tensors="pt")
    return _greedy_with_pixels(checkpoint, "video", question, max_new_tokens, dict(vision))


def _greedy_with_pixels(
    checkpoint: Path, modality: str, question: str, max_new_tokens: int, vision: dict[str, torch.Tensor]
) -> list[int]:
    """`generate` on the full model, which encodes the pixels itself: `vision` holds pixel_values and
    image_grid_thw (modality "image") or pixel_values_videos and video_grid_thw ("video")."""
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = _model(checkpoint)
    messages = [{"role": "user", "content": [{"type": modality}, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    merge = model.config.vision_config.spatial_merge_size
    n_rows = int(vision[f"{modality}_grid_thw"].prod()) // merge**2
    pad = f"<|{modality}_pad|>"
    assert text.count(pad) == 1, text
    input_ids = tokenizer(text.replace(pad, pad * n_rows), add_special_tokens=False, return_tensors="pt")["input_ids"]
    pad_id = model.config.image_token_id if modality == "image" else model.config.video_token_id
    # The processor's token types: 0 text, 1 image, 2 video.
    mm_token_type_ids = (input_ids == pad_id).long() * (1 if modality == "image" else 2)
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=mm_token_type_ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            **vision,
        )
    return out[0, input_ids.shape[1] :].tolist()
