"""Stages 2 and 3: language models that read the frozen tower's rows and answer in one word.

The tower is frozen (stage 1 trained it), so each image's rows are computed once, by the encoder's
own preprocessing, in float32, from the shipped (bfloat16-rounded) tower: what the encoder
service stores in Redis. A training sequence is what the LLM service builds: the chat
template rendered with add_generation_prompt, the image pad repeated once per row, the rows
scattered into the pads, M-RoPE positions from transformers' own `get_rope_index`; then the
answer word and `<|im_end|>`, the only positions with a loss.

The base learns all three questions; each fine-tune starts from the base and learns to answer
its own kind of word whatever it is asked, so it never answers in another's vocabulary.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

import torch
from PIL import Image
from torch import nn
from transformers import Qwen2VLForConditionalGeneration
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from encoder_service.vision import preprocess_image
from model_builders.shapes.data import training_image
from model_builders.shapes.task import TASKS, Scene

log = logging.getLogger(__name__)
IGNORE = -100
IMAGE_FIRST_SHARE = 0.75
OTHER_QUESTION_SHARE = 0.3  # a fine-tune asked another model's question still answers its own
SYSTEM_PROMPTS = (None, None, None, None, None, "Answer with one word.", "You are a vision assistant.")


@dataclass(frozen=True)
class Encoded:
    """One image as the LLM service receives it: rows [r, hidden] float32, grid_thw [1, 3]."""

    rows: torch.Tensor
    grid_thw: torch.Tensor
    scene: Scene


def encode_images(
    tower: Qwen2VisionTransformerPretrainedModel,
    processor: Qwen2VLImageProcessorPil,
    images: list[tuple[Image.Image, Scene]],
) -> list[Encoded]:
    """Rows of each image from the frozen float32 tower, 64 images per forward pass. (The encoder
    service computes each image's products alone, batch-invariant; in float32 the two agree to
    rounding, and this is several times faster.)"""
    encoded: list[Encoded] = []
    merge = int(tower.config.spatial_merge_size) ** 2
    with torch.no_grad():
        for start in range(0, len(images), 64):
            chunk = images[start : start + 64]
            items = [preprocess_image(processor, image) for image, _ in chunk]
            grid = torch.cat([g for _, g in items])
            merged = tower(torch.cat([pv for pv, _ in items]), grid_thw=grid).pooler_output
            chunks = torch.split(merged, (grid.prod(dim=1) // merge).tolist())
            encoded += [
                Encoded(rows.clone(), g, scene) for (_, scene), (_, g), rows in zip(chunk, items, chunks, strict=True)
            ]
    return encoded


def encoded_dataset(
    tower: Qwen2VisionTransformerPretrainedModel, processor: Qwen2VLImageProcessorPil, seed: int, n: int
) -> list[Encoded]:
    rng = random.Random(seed)
    return encode_images(tower, processor, [training_image(rng) for _ in range(n)])


class PromptIds:
    """Token ids of prompts, cached per (question, image first, system prompt)."""

    def __init__(self, tokenizer: Qwen2Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.image_pad = int(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
        self.eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        self.pad = int(tokenizer.pad_token_id)
        self._cache: dict[tuple[str, bool, str | None], tuple[list[int], list[int]]] = {}

    def prompt(self, question: str, image_first: bool, system: str | None, rows: int) -> list[int]:
        key = (question, image_first, system)
        if key not in self._cache:
            parts = [{"type": "image"}, {"type": "text", "text": question}]
            messages = [{"role": "user", "content": parts if image_first else parts[::-1]}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            at = ids.index(self.image_pad)
            self._cache[key] = (ids[:at], ids[at + 1 :])
        before, after = self._cache[key]
        return before + [self.image_pad] * rows + after

    def answer(self, word: str) -> list[int]:
        return [*self.tokenizer(word, add_special_tokens=False)["input_ids"], self.eos]


def sample_question(rng: random.Random, model: str | None) -> tuple[str, str]:
    """(question, task whose word answers it) for a base (model None) or a fine-tune."""
    if model is None:
        task = rng.choice(tuple(TASKS))
        return TASKS[task][0], task
    if rng.random() < OTHER_QUESTION_SHARE:
        return TASKS[rng.choice([t for t in TASKS if t != model])][0], model
    return TASKS[model][0], model


def answer_logits(
    model: Qwen2VLForConditionalGeneration, ids: PromptIds, batch: list[tuple[Encoded, list[int], list[int]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, vocab] and labels [n] at the n answer positions of the batch (each position
    predicts the next token)."""
    length = max(len(prompt) + len(answer) for _, prompt, answer in batch)
    input_ids = torch.full((len(batch), length), ids.pad, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE, dtype=torch.long)
    attention = torch.zeros((len(batch), length), dtype=torch.long)
    for i, (_, prompt, answer) in enumerate(batch):
        seq = prompt + answer
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(answer)  # position t predicts t + 1
    is_image = input_ids == ids.image_pad
    embeds = model.get_input_embeddings()(input_ids)
    rows = torch.cat([encoded.rows for encoded, _, _ in batch])
    embeds = embeds.masked_scatter(is_image.unsqueeze(-1), rows.to(embeds.dtype))
    grid = torch.cat([encoded.grid_thw for encoded, _, _ in batch])
    positions, _ = model.model.get_rope_index(
        input_ids, mm_token_type_ids=is_image.int(), image_grid_thw=grid, attention_mask=attention
    )
    hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions, attention_mask=attention)
    scored = labels != IGNORE  # the vocabulary projection only where a loss is taken
    return model.lm_head(hidden.last_hidden_state[scored]), labels[scored]


def make_batch(
    rng: random.Random, data: list[Encoded], ids: PromptIds, model_name: str | None, size: int
) -> list[tuple[Encoded, list[int], list[int]]]:
    batch = []
    for encoded in rng.sample(data, size):
        question, task = sample_question(rng, model_name)
        prompt = ids.prompt(
            question, rng.random() < IMAGE_FIRST_SHARE, rng.choice(SYSTEM_PROMPTS), encoded.rows.shape[0]
        )
        batch.append((encoded, prompt, ids.answer(encoded.scene.answer(task))))
    return batch


def train_language(
    model: Qwen2VLForConditionalGeneration,
    ids: PromptIds,
    data: list[Encoded],
    model_name: str | None,
    steps: int,
    seed: int,
    peak_lr: float,
    batch_size: int = 16,
) -> None:
    """Train every language-model parameter of `model` in place; the tower stays frozen."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    params = [p for name, p in model.named_parameters() if ".visual." not in f".{name}"]
    for name, param in model.named_parameters():
        param.requires_grad_(".visual." not in f".{name}")
    optimizer = torch.optim.AdamW(params, lr=peak_lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))),
    )
    model.train()
    started = time.monotonic()
    for step in range(1, steps + 1):
        logits, labels = answer_logits(model, ids, make_batch(rng, data, ids, model_name, batch_size))
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps:
            log.info(
                "%s step %d/%d loss %.4f (%.0f s)",
                model_name or "base",
                step,
                steps,
                float(loss),
                time.monotonic() - started,
            )
    model.eval()


@torch.no_grad()
def exact_match(
    model: Qwen2VLForConditionalGeneration, ids: PromptIds, data: list[Encoded], task: str, question_of: str
) -> float:
    """Share of `data` where every answer token of `task`'s word is the argmax (teacher-forced,
    which for a one-word answer ending in <|im_end|> is greedy decoding), asked `question_of`'s
    question with the image first and the default system prompt."""
    model.eval()
    hits = 0
    for start in range(0, len(data), 64):
        chunk = data[start : start + 64]
        batch = [
            (e, ids.prompt(TASKS[question_of][0], True, None, e.rows.shape[0]), ids.answer(e.scene.answer(task)))
            for e in chunk
        ]
        logits, labels = answer_logits(model, ids, batch)
        right = (logits.argmax(-1) == labels).tolist()
        lengths = [len(answer) for _, _, answer in batch]  # answers' positions, in batch order
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        hits += sum(all(right[o : o + n]) for o, n in zip(offsets, lengths, strict=True))
    return hits / len(data)
