"""Domain types for one Generate call, converted from the proto at the boundary.

Inner modules use these, never `*_pb2`.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_service.engines.base import MAX_TOP_LOGPROBS, SamplingParams
from shared.blob import Modality
from shared.errors import InvalidInput
from shared.pb.llm.v1 import llm_pb2

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class MediaInput:
    """An image or a video in a message: a stored key, or an inline safetensors blob."""

    modality: Modality
    key: str | None = None
    blob: bytes | None = None


@dataclass(frozen=True)
class Message:
    role: str
    parts: list[str | MediaInput]


@dataclass(frozen=True)
class SamplingLimits:
    default_max_tokens: int
    max_tokens_limit: int


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[Message]
    sampling: SamplingParams
    request_id: str

    @property
    def media(self) -> list[MediaInput]:
        """Every image and video, in prompt order."""
        return [part for message in self.messages for part in message.parts if isinstance(part, MediaInput)]

    @classmethod
    def from_pb(cls, request: llm_pb2.GenerateRequest, limits: SamplingLimits) -> ChatRequest:
        if not request.messages:
            raise InvalidInput("messages must not be empty", param="messages")
        messages = [_message_from_pb(m, i) for i, m in enumerate(request.messages)]
        return cls(request.model, messages, _sampling_from_pb(request.sampling, limits), request.request_id)


def _message_from_pb(message: llm_pb2.ChatMessage, index: int) -> Message:
    if message.role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}", param=f"messages[{index}].role")
    parts: list[str | MediaInput] = []
    for j, part in enumerate(message.content):
        which = part.WhichOneof("part")
        if which == "text":
            parts.append(part.text)
            continue
        ref = part.image if which == "image" else part.video if which == "video" else None
        source = ref.WhichOneof("source") if ref is not None else None
        if which not in ("image", "video") or source is None:
            raise InvalidInput(
                "content part must be text, or an image or video key/blob", param=f"messages[{index}].content[{j}]"
            )
        if source == "key":
            parts.append(MediaInput(which, key=ref.key))
        else:
            parts.append(MediaInput(which, blob=ref.embedding_blob))
    return Message(message.role, parts)


def _sampling_from_pb(sampling: llm_pb2.SamplingParams, limits: SamplingLimits) -> SamplingParams:
    max_tokens = sampling.max_tokens or limits.default_max_tokens
    if not 0 < max_tokens <= limits.max_tokens_limit:
        raise InvalidInput(f"max_tokens must be in 1..{limits.max_tokens_limit}", param="max_tokens")
    temperature = sampling.temperature if sampling.HasField("temperature") else 0.0
    if not 0.0 <= temperature <= 2.0:
        raise InvalidInput("temperature must be in [0, 2]", param="temperature")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise InvalidInput("top_p must be in (0, 1]", param="top_p")
    stop = list(sampling.stop)
    if len(stop) > 4 or any(not s for s in stop):
        raise InvalidInput("stop takes at most 4 non-empty strings", param="stop")
    seed = sampling.seed if sampling.HasField("seed") else None
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        logprobs=_logprobs_from_pb(sampling),
        presence_penalty=_penalty(sampling.presence_penalty, "presence_penalty"),
        frequency_penalty=_penalty(sampling.frequency_penalty, "frequency_penalty"),
    )


def _logprobs_from_pb(sampling: llm_pb2.SamplingParams) -> int | None:
    """OpenAI's pair (logprobs: bool, top_logprobs: k) as the engines' one knob: None or k."""
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", param="top_logprobs")
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidInput("top_logprobs needs logprobs set to true", param="top_logprobs")
    return sampling.top_logprobs if sampling.logprobs else None


def _penalty(value: float, param: str) -> float:
    if not -2.0 <= value <= 2.0:  # also refuses NaN
        raise InvalidInput(f"{param} must be in [-2, 2]", param=param)
    return value
