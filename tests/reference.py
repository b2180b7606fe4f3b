"""Independent greedy reference: transformers' own pieces only, none of our product code.

The prompt is rendered by the checkpoint's chat template, the image goes through
Qwen2VLImageProcessorPil, and the full model encodes `pixel_values` itself inside `generate`.
"""

from __future__ import annotations

from pathlib import Path

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
