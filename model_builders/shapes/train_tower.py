"""Stage 1: teach the vision tower the three labels before any language model sees it.

A small head reads the mean of the tower's merged output rows and predicts colour, count and
kind. Mean pooling is deliberate: the language models later read the rows through attention,
which is a weighted mean too, so the tower must spread what it sees (how many shapes, which kind)
over all rows rather than leave it in the rows that cover a shape. Without this stage a
from-scratch tower trained through the language model learned colour but stayed at chance on
count and shape (the issue's measurements).
"""

from __future__ import annotations

import logging
import math
import random
import time

import torch
from torch import nn
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from model_builders.shapes.data import HEADS, NUM_CLASSES, labels, pixel_batch, training_image

log = logging.getLogger(__name__)


class TowerClassifier(nn.Module):
    """The tower and a linear head on the mean of its rows. With `norm_rows` each row is
    RMS-normalised before the mean, as a language model's first layer normalises every row before
    its attention reads them: the head then sees what a language model's uniform attention sees."""

    def __init__(self, tower: Qwen2VisionTransformerPretrainedModel, norm_rows: bool = False) -> None:
        super().__init__()
        self.tower = tower
        hidden = int(tower.config.hidden_size)
        self.row_norm = nn.RMSNorm(hidden) if norm_rows else nn.Identity()
        self.head = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, NUM_CLASSES))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Logits [images, NUM_CLASSES] of the images in one packed batch."""
        return self.with_row_logits(pixel_values, grid_thw)[0]

    def with_row_logits(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of each image's mean row [images, NUM_CLASSES] and of each row alone [rows, NUM_CLASSES]."""
        merged = self.row_norm(self.tower(pixel_values, grid_thw=grid_thw).pooler_output)  # [rows, hidden]
        pooled = torch.stack([chunk.mean(dim=0) for chunk in torch.split(merged, rows_per_image(self.tower, grid_thw))])
        return self.head(pooled), self.head(merged)


def rows_per_image(tower: Qwen2VisionTransformerPretrainedModel, grid_thw: torch.Tensor) -> list[int]:
    return (grid_thw.prod(dim=1) // int(tower.config.spatial_merge_size) ** 2).tolist()


def head_losses(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        name: nn.functional.cross_entropy(logits[:, start : start + size], targets[:, i])
        for i, (name, (start, size)) in enumerate(HEADS.items())
    }


def accuracies(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    return {
        name: (logits[:, start : start + size].argmax(dim=1) == targets[:, i]).float().mean().item()
        for i, (name, (start, size)) in enumerate(HEADS.items())
    }


def train_tower(
    tower: Qwen2VisionTransformerPretrainedModel,
    processor: Qwen2VLImageProcessorPil,
    steps: int,
    batch_size: int,
    seed: int,
    peak_lr: float = 1e-3,
    warmup: int = 200,
    norm_rows: bool = False,
    loss_weights: dict[str, float] | None = None,
    row_loss: bool = False,
) -> dict[str, float]:
    """Train `tower` in place with a fresh head; returns the final held-out accuracy per head.
    `loss_weights` scales the heads' losses (1 where not given). With `row_loss` the head must also
    read the image's labels from every row alone: a language model's attention weighs rows
    unevenly, and a linear read-out of a weighted mean of rows that each give the right answer
    gives it too.

    (From a random tower, a loss at every row as well as at their mean reached lower held-out
    accuracy in the same steps than the mean alone: stage 1 leaves it out, stage 1d adds it.)"""
    torch.manual_seed(seed)
    weights = {name: 1.0 for name in HEADS} | (loss_weights or {})
    model = TowerClassifier(tower, norm_rows).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _warmup_cosine(step, steps, warmup))
    rng = random.Random(seed)
    started = time.monotonic()
    for step in range(1, steps + 1):
        images, scenes = zip(*(training_image(rng) for _ in range(batch_size)), strict=True)
        pixel_values, grid_thw = pixel_batch(processor, list(images))
        targets = torch.tensor([labels(scene) for scene in scenes])
        logits, row_logits = model.with_row_logits(pixel_values, grid_thw)
        losses = head_losses(logits, targets)
        if row_loss:
            row_targets = targets.repeat_interleave(torch.tensor(rows_per_image(tower, grid_thw)), dim=0)
            row_losses = head_losses(row_logits, row_targets)
            losses = {name: value + row_losses[name] for name, value in losses.items()}
        loss = sum(weights[name] * value for name, value in losses.items())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[union-attr]
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps:
            acc = accuracies(logits.detach(), targets)
            log.info(
                "tower step %d/%d loss %.3f train acc %s (%.0f s)",
                step,
                steps,
                float(loss),
                _fmt(acc),
                time.monotonic() - started,
            )
        if step % 500 == 0:
            log.info("tower step %d held-out acc %s", step, _fmt(evaluate(model, processor, seed + 10_000)))
    model.eval()
    return evaluate(model, processor, seed + 10_000)


@torch.no_grad()
def evaluate(model: TowerClassifier, processor: Qwen2VLImageProcessorPil, seed: int, n: int = 512) -> dict[str, float]:
    was_training = model.training
    model.eval()
    rng = random.Random(seed)
    all_logits, all_targets = [], []
    for _ in range(n // 64):
        images, scenes = zip(*(training_image(rng) for _ in range(64)), strict=True)
        pixel_values, grid_thw = pixel_batch(processor, list(images))
        all_logits.append(model(pixel_values, grid_thw))
        all_targets.append(torch.tensor([labels(scene) for scene in scenes]))
    model.train(was_training)
    return accuracies(torch.cat(all_logits), torch.cat(all_targets))


def _warmup_cosine(step: int, total: int, warmup: int = 200, floor: float = 0.03) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _fmt(values: dict[str, float]) -> str:
    return " ".join(f"{name}={value:.3f}" for name, value in values.items())
