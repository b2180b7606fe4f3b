"""Engine-agnostic request, sampling and streaming types, and the Engine protocol.

The service layer speaks only these types, so it never knows whether vLLM or transformers decodes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase, Qwen2VLConfig

FinishReason = Literal["stop", "length"]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default max_logprobs


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; seed makes sampling reproducible.

    logprobs: None = no logprobs; k = each token's logprob plus its k most likely alternatives.
    presence_penalty / frequency_penalty: OpenAI's (and vLLM's) penalties over the completion's
    tokens only: logit[t] -= presence * (count[t] > 0) + frequency * count[t].
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class EngineRequest:
    """One generation.

    prompt_token_ids: rendered prompt with each image's and video's pad token already expanded to
    its rows.
    image_embeds: one [rows, hidden] tensor per image, in prompt order.
    image_grid_thw: [n_images, 3] int64 (n may be 0).
    image_uuids: one stable id per image (its blob key), so an engine with a prefix cache can
    reuse an image's KV blocks across requests; None lets the engine hash the embeddings itself.
    video_*: the same for videos (grid t > 1 is allowed), filling the video pad tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    image_embeds: list[torch.Tensor]
    image_grid_thw: torch.Tensor
    sampling: SamplingParams = field(default_factory=SamplingParams)
    image_uuids: list[str] | None = None
    video_embeds: list[torch.Tensor] = field(default_factory=list)
    video_grid_thw: torch.Tensor = field(default_factory=lambda: torch.zeros((0, 3), dtype=torch.int64))
    video_uuids: list[str] | None = None

    def items(self, modality: str) -> tuple[list[torch.Tensor], torch.Tensor, list[str] | None]:
        """(embeds, grid, uuids) of "image" or "video"."""
        if modality == "image":
            return self.image_embeds, self.image_grid_thw, self.image_uuids
        return self.video_embeds, self.video_grid_thw, self.video_uuids


@dataclass(frozen=True)
class EngineShape:
    """What an engine's model accepts; checked before any request reaches it."""

    vocab_size: int
    hidden_size: int
    image_token_id: int
    video_token_id: int
    merge_size: int

    @classmethod
    def of(cls, config: Qwen2VLConfig) -> EngineShape:
        return cls(
            config.text_config.vocab_size,
            config.text_config.hidden_size,
            config.image_token_id,
            config.video_token_id,
            config.vision_config.spatial_merge_size,
        )

    @property
    def media_pads(self) -> tuple[tuple[str, int], ...]:
        """(modality, pad token id): images, then videos (the order of mm_token_type_ids 1 and 2)."""
        return (("image", self.image_token_id), ("video", self.video_token_id))


def validate_request(request: EngineRequest, shape: EngineShape) -> None:
    """Raises ValueError unless the request fits the model. Engines call this first: vLLM crashes
    its engine process on a rank-3 or wrong-width embedding, transformers fails deep inside generate."""
    ids = request.prompt_token_ids
    if not ids:
        raise ValueError("prompt is empty")
    if min(ids) < 0 or max(ids) >= shape.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {shape.vocab_size})")
    for modality, pad in shape.media_pads:
        _validate_items(modality, *request.items(modality), shape)
        pads, total = ids.count(pad), sum(e.shape[0] for e in request.items(modality)[0])
        if pads != total:
            raise ValueError(f"prompt has {pads} {modality} pad tokens but the {modality}s have {total} rows")


def _validate_items(
    modality: str, embeds: list[torch.Tensor], grid: torch.Tensor, uuids: list[str] | None, shape: EngineShape
) -> None:
    count = len(embeds)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] != count:
        raise ValueError(f"{modality}_grid_thw must be [{count}, 3], got {list(grid.shape)}")
    if uuids is not None and len(uuids) != count:
        raise ValueError(f"{len(uuids)} {modality} uuids for {count} {modality}s")
    for index, (rows_embeds, thw) in enumerate(zip(embeds, grid, strict=True)):
        rows = int(thw.prod()) // shape.merge_size**2
        if rows_embeds.ndim != 2 or tuple(rows_embeds.shape) != (rows, shape.hidden_size):
            raise ValueError(
                f"{modality} {index}: embeddings {list(rows_embeds.shape)}, expected {[rows, shape.hidden_size]}"
            )
        if modality == "image" and int(thw[0]) != 1:
            raise ValueError(f"image {index}: grid t must be 1, got {int(thw[0])} (send a video instead)")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and its most likely alternatives, most likely first.

    Both engines report vLLM's default kind, "raw_logprobs": log_softmax of the model's logits
    before penalties, temperature and top_p, so the numbers do not depend on the sampling knobs.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob)


def eos_token_ids(configured: int | list[int] | None, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a generation: the generation config's eos id(s) plus the tokenizer's.
    Both engines use this one set, so they stop on the same token."""
    ids = set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("checkpoint defines no eos token")
    return ids


@dataclass
class GenerationDelta:
    """A streamed piece of output. The last delta has finish_reason set; usage counts are running totals.

    token_ids may arrive with empty text while a multi-byte character is still incomplete.
    logprobs: with SamplingParams.logprobs set, one per token in token_ids, in order; else empty.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)


@runtime_checkable
class Engine(Protocol):
    hidden_size: int
    tokenizer: PreTrainedTokenizerBase
    # Most prompt plus completion tokens per request; the service checks prompts against it
    # (llm_service/context.py), so an engine never sees one that does not fit.
    max_model_len: int

    def failure(self) -> str | None:
        """Why the engine can no longer generate (its process died), or None while it can."""
        ...

    # Declared without `async`: implementations are async generators, which calling returns
    # an AsyncIterator directly (an `async def` here would type it as a coroutine).
    def generate(self, request: EngineRequest) -> AsyncIterator[GenerationDelta]:
        """Stream deltas for one request; closing the iterator cancels the generation."""
        ...

    def close(self) -> None:
        """Releases the model (and any engine process); the engine is unusable afterwards."""
        ...
