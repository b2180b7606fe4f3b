"""Chat completion flow: encode image_url and video parts once, route to the model's LLM
service, and re-encode once if a stored key vanished before the LLM read it."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gateway import metrics, summary
from gateway.backends import Backends
from gateway.errors import ENCODING, failing_as, model_subject
from gateway.inline_embeds import inline_blob
from gateway.schemas import ChatCompletionRequest, ImageUrlPart, MediaEmbedsPart, MediaPart, TextPart, VideoPart
from gateway.settings import GatewaySettings
from gateway.streams import merge_indexed
from shared.blob import Modality
from shared.errors import EmbeddingNotFound, InvalidInput, ServiceError, Unavailable
from shared.sampling_limits import SAMPLING_BOUNDS
from shared.sdk import (
    AsyncLLMClient,
    EncodedMedia,
    GenerationChunk,
    ImageKey,
    InlineEmbedding,
    Message,
    Sampling,
    VideoKey,
)

# What a key was encoded from: an image URL, or a video's frame URLs.
Source = str | tuple[str, ...]
ContentItem = str | ImageKey | VideoKey | InlineEmbedding


@dataclass
class PreparedChat:
    """The request in SDK form, plus the image URLs (or video frames) behind each key we produced."""

    messages: list[Message]
    sources: dict[str, Source]  # key -> what to encode again if the key vanishes


def _sampling(request: ChatCompletionRequest) -> Sampling:
    return Sampling(
        max_tokens=request.max_completion_tokens or request.max_tokens or 0,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=request.stop_list,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs or 0,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
    )


def _part_param(message_index: int, part_index: int) -> str:
    """How an error names a content part: by its path in the request."""
    return f"messages[{message_index}].content[{part_index}]"


def _media_parts(request: ChatCompletionRequest) -> list[tuple[str, MediaPart]]:
    """Every image and video part, in order, with its path (_part_param)."""
    return [
        (_part_param(i, j), part)
        for i, message in enumerate(request.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, MediaPart)
    ]


def _stored(modality: Modality, key: str) -> ImageKey | VideoKey:
    return ImageKey(key) if modality == "image" else VideoKey(key)


async def _encode(backends: Backends, source: Source, request_id: str, part_param: str | None = None) -> EncodedMedia:
    try:
        with failing_as(ENCODING):
            if isinstance(source, str):
                return await backends.encoder.encode(image_url=source, request_id=request_id)
            return await backends.encoder.encode_video(list(source), request_id=request_id)
    except ServiceError as error:
        if part_param is not None and error.kind.http_status < 500:  # the client's: name its field
            error.param = _request_param(part_param, source, error.param)
        raise


def _request_param(part_param: str, source: Source, encoder_param: str | None) -> str:
    """The request's field that an encoder's complaint is about. The encoder names its own fields
    (image_url, image, frames[1]), which a chat request does not have."""
    if isinstance(source, str):
        return f"{part_param}.image_url.url"
    frame = re.fullmatch(r"frames\[(\d+)\]", encoder_param or "")
    return f"{part_param}.video[{frame.group(1)}]" if frame else f"{part_param}.video"


def _media_field(part: MediaPart) -> str:
    """The field of a media part that holds its image or video, as the request spells it."""
    if isinstance(part, ImageUrlPart):
        return "image_url.url" if part.source is not None else "uuid"
    if isinstance(part, VideoPart):
        return "video"
    return "uuid" if part.uuid is not None else f"{part.modality}_embeds"


def _llm_param(request: ChatCompletionRequest, llm_param: str | None) -> str | None:
    """The request's field that an LLM service's complaint is about. The service names the fields
    of the GenerateRequest the gateway made of the request: its messages and parts are the
    request's, at the same indices (prepare), but a media part's field is the proto's
    (messages[0].content[1].image.key) and max_tokens is the proto's name for either token limit."""
    if llm_param == "max_tokens":
        return "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    at = re.match(r"messages\[(\d+)\]\.content\[(\d+)\]\.(image|video|text)\b", llm_param or "")
    if at is None:
        return llm_param
    i, j = int(at.group(1)), int(at.group(2))
    content = request.messages[i].content if i < len(request.messages) else None
    if isinstance(content, str):  # sent as the message's one text part
        return f"messages[{i}].content"
    part = content[j] if isinstance(content, list) and j < len(content) else None
    return f"{_part_param(i, j)}.{_media_field(part)}" if isinstance(part, MediaPart) else llm_param


@contextmanager
def _answering_for(request: ChatCompletionRequest) -> Iterator[None]:
    """Errors of the model's LLM services in the request's terms: a server-side one is the model's
    failure; a client's mistake names the request's own field (_llm_param)."""
    with failing_as(model_subject(request.model)):
        try:
            yield
        except ServiceError as error:
            if error.kind.http_status < 500:
                _rename_param(error, _llm_param(request, error.param))
            raise


def _rename_param(error: ServiceError, param: str | None) -> None:
    """Names `param` as the error's field, and in its message where the message begins with the
    old name ("max_tokens must be in 1..4096" for a request that set max_completion_tokens)."""
    if error.param and param and error.message.startswith(f"{error.param} "):
        error.message = param + error.message.removeprefix(error.param)
    error.param = param


async def _encode_sources(media: list[tuple[str, MediaPart]], backends: Backends, request_id: str) -> dict[Source, str]:
    """Source -> key, each distinct image URL or frame list encoded once, concurrently; an error
    names the first part that holds the source."""
    param_of: dict[Source, str] = {}
    for param, part in media:
        if isinstance(part, ImageUrlPart | VideoPart) and part.source is not None:
            param_of.setdefault(part.source, param)
    encoded = await asyncio.gather(*(_encode(backends, source, request_id, at) for source, at in param_of.items()))
    return {source: result.key for source, result in zip(param_of, encoded, strict=True)}


async def _inline(
    part: MediaEmbedsPart, param: str, request: ChatCompletionRequest, backends: Backends, settings: GatewaySettings
) -> InlineEmbedding:
    if not settings.allow_inline_embeds:
        raise InvalidInput(
            f"inline {part.modality}_embeds are disabled on this gateway; reference a stored key with uuid",
            param=param,
        )
    with failing_as(model_subject(request.model)):
        encoder_ids = (await backends.model_info(request.model)).accepted_encoder_ids
    assert part.embeds is not None and part.grid_thw is not None  # checked by the schema
    # Its faults name the field that holds the rows, as those the LLM service finds do (_llm_param).
    blob = inline_blob(part.embeds, part.grid_thw, encoder_ids[0], f"{param}.{_media_field(part)}", part.modality)
    return InlineEmbedding(blob, part.modality)


async def _content_item(
    part: TextPart | MediaPart, param: str, key_of: dict[Source, str], request: ChatCompletionRequest, backends: Backends,
    settings: GatewaySettings,
) -> ContentItem:  # fmt: skip
    if isinstance(part, ImageUrlPart | VideoPart):
        source = part.source
        if source is not None:
            return _stored(part.modality, key_of[source])
        assert isinstance(part, ImageUrlPart) and part.uuid is not None  # vLLM's form; the schema checked
        return _stored(part.modality, part.uuid)
    if isinstance(part, MediaEmbedsPart) and part.uuid is not None:
        return _stored(part.modality, part.uuid)
    if isinstance(part, MediaEmbedsPart):
        return await _inline(part, param, request, backends, settings)
    return part.text


async def prepare(
    request: ChatCompletionRequest, backends: Backends, settings: GatewaySettings, request_id: str
) -> PreparedChat:
    """Turns every image and video part into a stored key or an inline blob, in order."""
    media = _media_parts(request)
    if len(media) > settings.max_media_per_request:
        raise InvalidInput(
            f"{len(media)} images and videos in one request; the limit is {settings.max_media_per_request}",
            param="messages",
        )
    key_of = await _encode_sources(media, backends, request_id)
    messages = []
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append(Message(message.role, [message.content]))
            continue
        content = [
            await _content_item(part, _part_param(i, j), key_of, request, backends, settings)
            for j, part in enumerate(message.content)
        ]
        messages.append(Message(message.role, content))
    stored = (item.key for m in messages for item in m.content if isinstance(item, ImageKey | VideoKey))
    summary.current().note_keys(stored)
    return PreparedChat(messages, {key: source for source, key in key_of.items()})


async def _start(
    llm: AsyncLLMClient, request: ChatCompletionRequest, chat: PreparedChat, sampling: Sampling, request_id: str
) -> tuple[AsyncIterator[GenerationChunk], GenerationChunk]:
    # A client that does not stream reads nothing before the end: one message per choice then, not
    # one per token, which would cost both processes CPU per token for nobody.
    stream = llm.generate(request.model, chat.messages, sampling, request_id, single_chunk=not request.stream)
    return stream, await anext(stream)


async def _opened(
    request: ChatCompletionRequest, chat: PreparedChat, backends: Backends, sampling: Sampling, request_id: str
) -> tuple[AsyncIterator[GenerationChunk], GenerationChunk]:
    """A choice's stream and its first chunk. Before any output a retry repeats nothing, so: a
    service that is UNAVAILABLE is passed over for another one of the model (once), and a
    missing key we can re-encode is re-encoded and the request retried (once)."""
    llm = backends.llm_for(request.model)
    try:
        return await _start(llm, request, chat, sampling, request_id)
    except Unavailable:
        other = backends.instead_of(request.model, llm)
        if other is None:
            raise
        return await _start(other, request, chat, sampling, request_id)
    except EmbeddingNotFound as error:
        if not _all_ours(error, chat):
            raise
        await asyncio.gather(*(_encode(backends, chat.sources[key], request_id) for key in error.keys))
        try:
            return await _start(llm, request, chat, sampling, request_id)
        except EmbeddingNotFound as again:
            if not _all_ours(again, chat):
                raise
            # Stored twice for this request and gone twice before its LLM service read them: the
            # store evicts faster than requests use what it holds (Redis at maxmemory). Not the
            # client's doing, whose request named no key: a 404 named keys it never sent.
            with failing_as(ENCODING):
                evicted = ", ".join(again.keys)
                raise Unavailable(f"keys stored for this request were evicted before use, twice: {evicted}") from None


def _all_ours(error: EmbeddingNotFound, chat: PreparedChat) -> bool:
    """Whether every key the LLM service missed is one this gateway stored from the request's sources."""
    return bool(error.keys) and all(key in chat.sources for key in error.keys)


def _finished(request: ChatCompletionRequest, chunk: GenerationChunk, first_at: float) -> None:
    """Counts a choice's last chunk: its tokens, and the time per token after the first."""
    summary.current().note_usage(chunk.prompt_tokens, chunk.completion_tokens)
    metrics.TOKENS.labels(request.model).inc(chunk.completion_tokens)
    if request.stream and chunk.completion_tokens > 1:  # decode time per token after the first
        per_token = (time.perf_counter() - first_at) / (chunk.completion_tokens - 1)
        metrics.TOKEN_SECONDS.labels(request.model).observe(per_token)


async def _one_choice(
    request: ChatCompletionRequest, chat: PreparedChat, backends: Backends, sampling: Sampling, request_id: str
) -> AsyncIterator[GenerationChunk]:
    """One choice's chunks, from one LLM service of the model."""
    started = time.perf_counter()
    with _answering_for(request):
        stream, first = await _opened(request, chat, backends, sampling, request_id)
    first_at = time.perf_counter()
    if request.stream:  # else this first chunk is the whole choice
        metrics.TTFT_SECONDS.labels(request.model).observe(first_at - started)
        summary.current().note_first_token()
    if first.finish_reason is not None:  # a one-message answer (max_tokens 1, an immediate stop)
        _finished(request, first, first_at)
    last = first
    try:
        yield first
        # The consumer asks for the next chunk once it has sent this one as a response event, so
        # the time spent in each yield is the relay (with n > 1, only the hand-over to the merging
        # queue).
        relaying = time.perf_counter() - first_at
        with _answering_for(request):
            async for last in stream:
                if last.finish_reason is not None:
                    _finished(request, last, first_at)
                handed = time.perf_counter()
                yield last
                relaying += time.perf_counter() - handed
        metrics.STAGE_SECONDS.labels("relay").observe(relaying)
    finally:
        if last.finish_reason is None:  # cut off (its service failed, the client left): what it got
            summary.current().note_usage(last.prompt_tokens, last.completion_tokens)


def choice_seed(seed: int, index: int) -> int:
    """seed + index, wrapped into the seeds' range (0..2**63-1), so that every valid seed is valid
    with every n: past the top, seed + index was out of the gRPC field's range, a 500."""
    bound = SAMPLING_BOUNDS["seed"]
    low, span = int(bound.low), int(bound.high - bound.low) + 1
    return low + (seed + index - low) % span


def generate(
    request: ChatCompletionRequest, chat: PreparedChat, backends: Backends, request_id: str
) -> AsyncGenerator[tuple[int, GenerationChunk], None]:
    """(choice index, chunk) for all `n` choices; a seeded request seeds choice i with seed + i."""
    sampling = _sampling(request)
    streams = []
    for index in range(request.n):
        seeded = (
            sampling if sampling.seed is None else dataclasses.replace(sampling, seed=choice_seed(sampling.seed, index))
        )
        streams.append(_one_choice(request, chat, backends, seeded, f"{request_id}-{index}"))
    return merge_indexed(streams)
