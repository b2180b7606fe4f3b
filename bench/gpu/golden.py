"""The golden check on the device: the transformers engine, fed our encoder's embeddings through a
blob, gives transformers' own greedy tokens (tests/test_model_code.py's check, here on `device`).

Both sides run on the device in float32, on the tiny checkpoints (fine-tunes ft-a and ft-b of one
base). Ours: the encoder service's VisionEncoder (batch-invariant tower, its own preprocessing),
its output made a blob and decoded as the LLM service does, then TransformersEngine. Theirs:
transformers' PIL image processor and the full model's `generate(pixel_values=...)`, as
tests/reference.py runs it (which uses AutoImageProcessor, whose default class needs torchvision:
the GPU host has none). The images' sides are multiples of 28 inside the processor's bounds, so
no resize happens and both processors must give the same pixels; that is checked too. A case
proves little unless cases differ, so the outputs must all be distinct.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import PreTrainedTokenizerBase, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from bench.outcome import ScenarioResult, Target
from bench.workload import make_image
from encoder_service.blob_arrays import blob_from_tensors
from encoder_service.vision import VisionEncoder
from llm_service.blob_tensors import embeds_tensor, grid_tensor
from llm_service.chat_request import MediaInput, PromptMessage
from llm_service.engines.base import EngineRequest, MediaItem, SamplingParams
from llm_service.engines.transformers_engine import TransformersEngine
from llm_service.prompt import PromptBuilder
from model_builders.tiny import build_all
from shared.blob import BlobRules, decode_blob, encode_blob

FINETUNES = ("ft-a", "ft-b")
IMAGES = ((1, 112), (2, 168))  # (seed, side): no resize between the tiny processor's 56x56 and 224x224
QUESTIONS = ("What is in this picture?", "Describe the room.")
MAX_NEW_TOKENS = 12
ENCODER_ID = "golden"
PAD = "<|image_pad|>"


def _engine_tokens(engine: TransformersEngine, item: MediaItem, question: str) -> list[int]:
    ids = PromptBuilder(engine.tokenizer).build([PromptMessage("user", [MediaInput("image"), question])])
    request = EngineRequest("golden", ids, [item], SamplingParams(max_tokens=MAX_NEW_TOKENS))

    async def collect() -> list[int]:
        return [token async for delta in engine.generate(request) for token in delta.token_ids]

    return asyncio.run(collect())


def _reference_tokens(
    model: Qwen2VLForConditionalGeneration, tokenizer: PreTrainedTokenizerBase, vision: dict[str, torch.Tensor],
    question: str, merge_size: int,
) -> list[int]:  # fmt: skip
    """tests/reference.py's `_greedy_with_pixels`, on the model's device."""
    device = model.device
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[arg-type]
    assert isinstance(text, str)  # tokenize=False renders text
    rows = int(vision["image_grid_thw"].prod()) // merge_size**2
    input_ids = tokenizer(text.replace(PAD, PAD * rows), add_special_tokens=False, return_tensors="pt")["input_ids"]
    input_ids = input_ids.to(device)
    with torch.inference_mode():
        # type: ignore: transformers types generate's self as a protocol its models do not declare.
        out = model.generate(  # type: ignore[misc]
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == model.config.image_token_id).long(),
            do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS,
            pixel_values=vision["pixel_values"].to(device),
            image_grid_thw=vision["image_grid_thw"].to(device),
        )
    return [int(token) for token in out[0, input_ids.shape[1] :]]


def _through_blob(encoder: VisionEncoder, embeds: torch.Tensor, grid: torch.Tensor) -> MediaItem:
    """The encoder's output as the LLM service receives it: blob bytes, decoded, as tensors."""
    rules = BlobRules(encoder.merge_size, encoder.hidden_size, frozenset({ENCODER_ID}))
    data = encode_blob(blob_from_tensors(embeds, grid, ENCODER_ID, "image"), rules)
    blob = decode_blob(data, rules)
    return MediaItem("image", embeds_tensor(blob), grid_tensor(blob))


def run_golden(root: Path, device: torch.device) -> ScenarioResult:
    checkpoints = build_all(root)
    encoder = VisionEncoder.load(str(checkpoints["base"]), str(device), torch.float32)
    processor = Qwen2VLImageProcessorPil.from_pretrained(checkpoints["base"])
    images = [Image.open(io.BytesIO(make_image(seed, side))).convert("RGB") for seed, side in IMAGES]
    rows: dict[str, dict[str, Any]] = {}
    for name in FINETUNES:
        engine = TransformersEngine.load(str(checkpoints[name]), str(device), torch.float32)
        model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoints[name], dtype=torch.float32).eval()
        model = model.to(device)
        try:
            for (seed, side), image in zip(IMAGES, images, strict=True):
                pixels, grid = encoder.preprocess(image)
                vision = dict(processor(images=[image], return_tensors="pt"))
                (embeds,) = encoder.encode_batch([(pixels, grid)])
                item = _through_blob(encoder, embeds, grid)
                for question in QUESTIONS:
                    ours = _engine_tokens(engine, item, question)
                    theirs = _reference_tokens(model, engine.tokenizer, vision, question, encoder.merge_size)
                    rows[f"{name}, image {seed} ({side}x{side}), {question!r}"] = {
                        "pixels equal": bool(torch.equal(pixels, vision["pixel_values"])),
                        "tokens equal": ours == theirs,
                        "ours": " ".join(map(str, ours)),
                        "transformers": " ".join(map(str, theirs)),
                    }
        finally:
            engine.close()
    return _result(rows, device)


def _result(rows: dict[str, dict[str, Any]], device: torch.device) -> ScenarioResult:
    result = ScenarioResult(
        "golden", f"Golden check on {device.type}: transformers engine vs transformers generate (float32)",
        ["pixels equal", "tokens equal", "ours", "transformers"], rows,
        config={"checkpoints": "tiny (model_builders/tiny.py)", "max_new_tokens": MAX_NEW_TOKENS, "dtype": "float32"},
    )  # fmt: skip
    cases = len(rows)
    result.targets += [
        Target("cases whose greedy tokens equal transformers'", sum(r["tokens equal"] for r in rows.values()), "==", cases),
        Target("cases whose pixels equal transformers' processor's", sum(r["pixels equal"] for r in rows.values()), "==", cases),
        Target("distinct outputs among the cases", len({r["transformers"] for r in rows.values()}), "==", cases),
    ]  # fmt: skip
    return result
