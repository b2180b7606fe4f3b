"""Chat completion flow: encode image_url parts once, route to the model's LLM
service, and re-encode once if a stored key vanished before the LLM read it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway import metrics
from gateway.backends import Backends
from gateway.inline_embeds import inline_blob
from gateway.schemas import ChatCompletionRequest, ImageEmbedsPart, ImageUrlPart
from gateway.settings import GatewaySettings
from gateway.streams import merge_indexed
from shared.errors import EmbeddingNotFound, InvalidInput
from shared.sdk import GenerationChunk, ImageKey, InlineEmbedding, Message, Sampling


@dataclass
class PreparedChat:
    """The request in SDK form, plus the image URLs behind each key we produced."""

    messages: list[Message]
    sources: dict[str, str]  # key -> image URL, for re-encoding


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


def _image_parts(request: ChatCompletionRequest) -> list[tuple[str, ImageUrlPart | ImageEmbedsPart]]:
    """(param path, part) of every image part, in order."""
    return [
        (f"messages[{i}].content[{j}]", part)
        for i, message in enumerate(request.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, ImageUrlPart | ImageEmbedsPart)
    ]


async def _encode_urls(request: ChatCompletionRequest, backends: Backends, request_id: str) -> dict[str, str]:
    """URL -> key, each distinct URL encoded once, concurrently."""
    urls = list(dict.fromkeys(p.image_url.url for _, p in _image_parts(request) if isinstance(p, ImageUrlPart)))
    encoded = await asyncio.gather(*(backends.encoder.encode(image_url=url, request_id=request_id) for url in urls))
    return {url: result.key for url, result in zip(urls, encoded, strict=True)}


async def _inline(
    part: ImageEmbedsPart, param: str, request: ChatCompletionRequest, backends: Backends, settings: GatewaySettings
) -> InlineEmbedding:
    if not settings.allow_inline_embeds:
        raise InvalidInput(
            "inline image_embeds are disabled on this gateway; reference a stored key with uuid", param=param
        )
    encoder_ids = (await backends.model_info(request.model)).accepted_encoder_ids
    assert part.image_embeds is not None and part.image_grid_thw is not None  # checked by the schema
    return InlineEmbedding(inline_blob(part.image_embeds, part.image_grid_thw, encoder_ids[0], param))


async def prepare(
    request: ChatCompletionRequest, backends: Backends, settings: GatewaySettings, request_id: str
) -> PreparedChat:
    """Turns every image part into a stored key or an inline blob, in order."""
    images = _image_parts(request)
    if len(images) > settings.max_images_per_request:
        raise InvalidInput(
            f"{len(images)} images in one request; the limit is {settings.max_images_per_request}", param="messages"
        )
    key_of = await _encode_urls(request, backends, request_id)
    messages = []
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append(Message(message.role, [message.content]))
            continue
        content: list[str | ImageKey | InlineEmbedding] = []
        for j, part in enumerate(message.content):
            if isinstance(part, ImageUrlPart):
                content.append(ImageKey(key_of[part.image_url.url]))
            elif isinstance(part, ImageEmbedsPart) and part.uuid is not None:
                content.append(ImageKey(part.uuid))
            elif isinstance(part, ImageEmbedsPart):
                content.append(await _inline(part, f"messages[{i}].content[{j}]", request, backends, settings))
            else:
                content.append(part.text)
        messages.append(Message(message.role, content))
    return PreparedChat(messages, {key: url for url, key in key_of.items()})


async def _one_choice(
    request: ChatCompletionRequest, chat: PreparedChat, backends: Backends, sampling: Sampling, request_id: str
) -> AsyncIterator[GenerationChunk]:
    """One choice's chunks. A missing key we can re-encode is re-encoded and retried once."""
    llm = backends.llm_for(request.model)
    started = time.perf_counter()
    stream = llm.generate(request.model, chat.messages, sampling, request_id)
    try:
        first = await anext(stream)
    except EmbeddingNotFound as error:
        lost = [key for key in error.keys if key in chat.sources]
        if not lost or len(lost) != len(error.keys):
            raise
        await asyncio.gather(
            *(backends.encoder.encode(image_url=chat.sources[key], request_id=request_id) for key in lost)
        )
        stream = llm.generate(request.model, chat.messages, sampling, request_id)
        first = await anext(stream)
    first_at = time.perf_counter()
    metrics.TTFT_SECONDS.labels(request.model).observe(first_at - started)
    yield first
    async for chunk in stream:
        if chunk.finish_reason is not None:
            metrics.TOKENS.labels(request.model).inc(chunk.completion_tokens)
            if chunk.completion_tokens > 1:  # decode time per token after the first
                per_token = (time.perf_counter() - first_at) / (chunk.completion_tokens - 1)
                metrics.TOKEN_SECONDS.labels(request.model).observe(per_token)
        yield chunk


def generate(
    request: ChatCompletionRequest, chat: PreparedChat, backends: Backends, request_id: str
) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """(choice index, chunk) for all `n` choices; a seeded request seeds choice i with seed + i."""
    sampling = _sampling(request)
    streams = []
    for index in range(request.n):
        seeded = dataclasses.replace(sampling, seed=sampling.seed + index) if sampling.seed is not None else sampling
        streams.append(_one_choice(request, chat, backends, seeded, f"{request_id}-{index}"))
    return merge_indexed(streams)
