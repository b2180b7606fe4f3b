"""Domain types for one Generate call, converted from the proto at the boundary.

Inner modules use these, never `*_pb2`.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_service.engines.base import SamplingParams
from shared.blob import Modality
from shared.errors import InvalidInput
from shared.pb.llm.v1 import llm_pb2
from shared.sampling_limits import check_sampling, check_stop

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class MediaInput:
    """An image or a video in a message: a stored key, or an inline safetensors blob."""

    modality: Modality
    key: str | None = None
    blob: bytes | None = None
    at: str = ""  # the part's path in the request, messages[i].content[j]; "" outside a request

    @property
    def param(self) -> str | None:
        """The request's field that holds it, as an error names it: the GenerateRequest's own path,
        messages[i].content[j].image.key (a video's: .video.key; inline: .embedding_blob)."""
        if not self.at:
            return None
        return f"{self.at}.{self.modality}.{'key' if self.key is not None else 'embedding_blob'}"


@dataclass(frozen=True)
class PromptMessage:
    """One chat message as the prompt builder renders it: text and media parts in order."""

    role: str
    parts: list[str | MediaInput]


@dataclass(frozen=True)
class SamplingLimits:
    default_max_tokens: int
    max_tokens_limit: int


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: list[PromptMessage]
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


def _message_from_pb(message: llm_pb2.ChatMessage, index: int) -> PromptMessage:
    if message.role not in ROLES:
        raise InvalidInput(f"role must be one of {', '.join(ROLES)}", param=f"messages[{index}].role")
    parts: list[str | MediaInput] = []
    for j, part in enumerate(message.content):
        which, at = part.WhichOneof("part"), f"messages[{index}].content[{j}]"
        if which == "text":
            parts.append(part.text)
            continue
        ref = part.image if which == "image" else part.video if which == "video" else None
        source = None if ref is None else ref.WhichOneof("source")
        if ref is None or source is None:
            raise InvalidInput("content part must be text, or an image or video key/blob", param=at)
        if source == "key":
            parts.append(MediaInput(which, key=ref.key, at=at))
        else:
            parts.append(MediaInput(which, blob=ref.embedding_blob, at=at))
    return PromptMessage(message.role, parts)


def _sampling_from_pb(sampling: llm_pb2.SamplingParams, limits: SamplingLimits) -> SamplingParams:
    """Unset knobs take OpenAI's defaults, except temperature, which is 0 (greedy): what vLLM
    gives Qwen2-VL-Instruct and its fine-tunes, whose generation_config (top_k 1) it applies by
    default; OpenAI's 1 would sample. Every bound is shared/sampling_limits.py's, except
    max_tokens, whose limit is this service's own."""
    max_tokens = sampling.max_tokens or limits.default_max_tokens
    if not 0 < max_tokens <= limits.max_tokens_limit:
        raise InvalidInput(f"max_tokens must be in 1..{limits.max_tokens_limit}", param="max_tokens")
    temperature = sampling.temperature if sampling.HasField("temperature") else 0.0
    check_sampling("temperature", temperature)
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    check_sampling("top_p", top_p)
    stop = list(sampling.stop)
    check_stop(stop)
    logprobs = _logprobs_from_pb(sampling)
    check_sampling("presence_penalty", sampling.presence_penalty)
    check_sampling("frequency_penalty", sampling.frequency_penalty)
    seed = sampling.seed if sampling.HasField("seed") else None
    if seed is not None:  # the gateway refuses a negative seed; so does every other way in
        check_sampling("seed", seed)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
    )


def _logprobs_from_pb(sampling: llm_pb2.SamplingParams) -> int | None:
    """OpenAI's pair (logprobs: bool, top_logprobs: k) as the engines' one knob: None or k."""
    check_sampling("top_logprobs", sampling.top_logprobs)
    if sampling.top_logprobs and not sampling.logprobs:
        raise InvalidInput("top_logprobs needs logprobs set to true", param="top_logprobs")
    return sampling.top_logprobs if sampling.logprobs else None
