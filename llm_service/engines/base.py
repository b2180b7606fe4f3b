"""Engine-agnostic request, sampling and streaming types, and the Engine protocol.

The service layer speaks only these types, so it never knows whether vLLM or transformers decodes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch
from transformers import PreTrainedConfig, PreTrainedTokenizerBase, Qwen2VLConfig

from shared.blob import Modality, tokens_for_grid
from shared.sampling_limits import MAX_STOP_STRINGS, SAMPLING_BOUNDS

FinishReason = Literal["stop", "length"]
ModelDtype = Literal["float32", "bfloat16", "float16"]  # the language model's, as LLMSettings.dtype names it


@dataclass
class SamplingParams:
    """How to pick tokens. temperature 0 means greedy; seed makes sampling reproducible.

    logprobs: None = no logprobs; k = each token's logprob plus its k most likely alternatives.
    presence_penalty / frequency_penalty: OpenAI's (and vLLM's) penalties over the completion's
    tokens only: logit[t] -= presence * (count[t] > 0) + frequency * count[t].
    Bounds: shared/sampling_limits.py, the table the request conversion checks too; here they
    guard an engine handed params directly.
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
        knobs = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_logprobs": self.logprobs,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
        }
        for name, value in knobs.items():
            bound = SAMPLING_BOUNDS[name]
            if value is not None and not bound.holds(value):
                raise ValueError(f"{name} must be in {bound.describe()}, got {value}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class MediaItem:
    """One image or video of the prompt, as an engine takes it.

    embeds: [rows, hidden], any float dtype; shares the cached blob's memory, so engines copy it
    before anything could write it.
    grid_thw: [1, 3] int64, the item's (t, h, w) in patches; rows == tokens_for_grid(grid_thw,
    merge_size). An image has t == 1 (the service refuses others: llm_service/core.py).
    uuid: names the content for an engine's prefix cache (the blob key, or "inline:sha256:<hex>"
    for an inline blob); None lets the engine hash the embeddings itself.
    """

    modality: Modality
    embeds: torch.Tensor
    grid_thw: torch.Tensor
    uuid: str | None = None

    @property
    def rows(self) -> int:
        return int(self.embeds.shape[0])


@dataclass
class EngineRequest:
    """One generation.

    prompt_token_ids: the rendered prompt with ONE pad token (`<|image_pad|>` / `<|video_pad|>`)
    per media item: vLLM expands each pad into the item's rows itself, the transformers engine
    expands them before scattering the rows.
    media: every image and video, in prompt order: item i fills the i-th pad.
    """

    request_id: str
    prompt_token_ids: list[int]
    media: list[MediaItem] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length as the model reads it, each pad counted as its item's rows: what
        fills the context window and what usage reports."""
        return len(self.prompt_token_ids) + sum(item.rows - 1 for item in self.media)


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
        text = sub_config(config, "text_config")
        return cls(
            text.vocab_size,
            text.hidden_size,
            config.image_token_id,
            config.video_token_id,
            sub_config(config, "vision_config").spatial_merge_size,
        )

    def pad_of(self, modality: Modality) -> int:
        return self.image_token_id if modality == "image" else self.video_token_id

    @property
    def pads(self) -> frozenset[int]:
        """The prompt tokens that stand for a media item."""
        return frozenset((self.image_token_id, self.video_token_id))


def validate_request(request: EngineRequest, shape: EngineShape) -> None:
    """Raises ValueError unless the request fits the model. Engines call this first: vLLM crashes
    its engine process on a rank-3 or wrong-width embedding and silently accepts rows that
    disagree with the grid; transformers fails deep inside generate.

    The service hands over validated blobs (shared/blob.py); this checks what a blob cannot know:
    the prompt's pads against the items, and each item against this model."""
    ids = request.prompt_token_ids
    if not ids:
        raise ValueError("prompt is empty")
    if min(ids) < 0 or max(ids) >= shape.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {shape.vocab_size})")
    pads = shape.pads
    if [token for token in ids if token in pads] != [shape.pad_of(item.modality) for item in request.media]:
        raise ValueError(
            f"the prompt's image/video pad tokens do not match the {len(request.media)} media item(s) "
            "(one pad per item, of its modality, in order)"
        )
    for index, item in enumerate(request.media):
        _validate_item(index, item, shape)


def _validate_item(index: int, item: MediaItem, shape: EngineShape) -> None:
    where = f"{item.modality} {index}"
    if tuple(item.grid_thw.shape) != (1, 3):
        raise ValueError(f"{where}: grid_thw must be [1, 3], got {list(item.grid_thw.shape)}")
    rows = tokens_for_grid(item.grid_thw, shape.merge_size)
    if item.embeds.ndim != 2 or tuple(item.embeds.shape) != (rows, shape.hidden_size):
        raise ValueError(f"{where}: embeddings {list(item.embeds.shape)}, expected {[rows, shape.hidden_size]}")


@dataclass(frozen=True)
class SampledToken:
    """A generated token's log probability and its most likely alternatives, most likely first.

    Both engines report vLLM's default kind, "raw_logprobs": log_softmax of the model's logits
    before penalties, temperature and top_p, so the numbers do not depend on the sampling knobs.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob)


def sub_config(config: PreTrainedConfig, name: str) -> PreTrainedConfig:
    """config.text_config or config.vision_config; transformers types them as config, dict or None."""
    sub = getattr(config, name, None)
    if not isinstance(sub, PreTrainedConfig):
        raise ValueError(f"checkpoint config has no {name}")
    return sub


def decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    """Generated text as both engines emit it. No cleanup of spaces: it would rewrite text already
    streamed (" ." -> "."), so the pieces would no longer add up to the whole."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert isinstance(text, str)  # one sequence in, one string out
    return text


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
    logprobs: list[SampledToken] = field(default_factory=list)


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

    @property
    def longest_step_tokens(self) -> int:
        """Most prompt tokens one step of the engine computes, between two chances to answer a
        `probe`: the longest legitimate silence of the engine, which the stall limit must exceed
        (llm_service/server.py sizes it from this). By default the engine prefills a whole prompt
        in one step."""
        return self.max_model_len

    async def probe(self) -> None:
        """Returns once the engine has answered a round trip that it can answer only between two
        of its steps, so that it does not return while the engine is frozen or hung mid-step. The
        service sends one every LLM_ENGINE_PROBE_S, busy or idle, and counts it as work owed to the
        hung-engine watch (shared/progress_watch.py): an engine frozen while idle is caught too.
        It must cost next to nothing and leave requests in the engine alone. This default answers
        at once: right only for an engine that has no compute of its own to hang (a stand-in)."""
        return None

    async def freeze_startup_heaps(self) -> int:
        """Freezes the start-up heap (shared/gc_heap.py) of each process the engine runs apart
        from the service, once warmed up; returns how many objects they froze (0: it runs none)."""
        ...

    def close(self) -> None:
        """Releases the model (and any engine process); the engine is unusable afterwards."""
        ...
