"""Logits processors the transformers engine adds to `generate`, to match vLLM's sampler.

Order matters. transformers runs its own processors first (none with the engine's generation
config), then ours in list order, then the sampling warpers (temperature, top_p). So
`RawLogprobs` first sees the raw logits, as vLLM's default logprobs_mode "raw_logprobs" does, and
`Penalties` then applies before temperature, as vLLM applies them.
"""

from __future__ import annotations

from typing import cast

import torch
from transformers import LogitsProcessor


class RawLogprobs(LogitsProcessor):
    """Keeps log_softmax of the step's raw logits for the token about to be chosen.

    `row` is [vocab] float32 for the latest step (batch size is always 1 here).
    """

    def __init__(self) -> None:
        self.row: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.row = torch.log_softmax(scores[0].float(), dim=-1)
        return scores


class Penalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens only (vLLM's semantics):
    logits[t] -= presence * (count[t] > 0) + frequency * count[t]."""

    def __init__(self, prompt_tokens: int, presence: float, frequency: float) -> None:
        self.prompt_tokens = prompt_tokens
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_tokens :]  # [batch, generated so far]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        penalized = scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts
        return cast(torch.FloatTensor, penalized)
