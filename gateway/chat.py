"""Chat completion flow: encode image_url parts once, route to the model's LLM
service, and re-encode once if a stored key vanished before the LLM read it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.backends import Backends
from gateway.schemas import ChatCompletionRequest, ImageEmbedsPart, ImageUrlPart
from shared.errors import EmbeddingNotFound, InvalidInput
from shared.sdk import GenerationChunk, ImageKey, Message, Sampling


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
    )


async def prepare(request: ChatCompletionRequest, backends: Backends, max_images: int) -> PreparedChat:
    """Turns every image_url part into a stored key (each distinct URL encoded once)."""
    urls = [
        part.image_url.url
        for message in request.messages
        if isinstance(message.content, list)
        for part in message.content
        if isinstance(part, ImageUrlPart)
    ]
    image_count = sum(
        isinstance(p, ImageUrlPart | ImageEmbedsPart) for m in request.messages if isinstance(m.content, list) for p in m.content
    )
    if image_count > max_images:
        raise InvalidInput(f"{image_count} images in one request; the limit is {max_images}", param="messages")
    distinct = list(dict.fromkeys(urls))
    encoded = await asyncio.gather(*(backends.encoder.encode(image_url=url) for url in distinct))
    key_of = {url: result.key for url, result in zip(distinct, encoded, strict=True)}
    messages = []
    for message in request.messages:
        if isinstance(message.content, str):
            messages.append(Message(message.role, [message.content]))
            continue
        content: list[str | ImageKey] = []
        for part in message.content:
            if isinstance(part, ImageUrlPart):
                content.append(ImageKey(key_of[part.image_url.url]))
            elif isinstance(part, ImageEmbedsPart):
                content.append(ImageKey(part.uuid))
            else:
                content.append(part.text)
        messages.append(Message(message.role, content))
    return PreparedChat(messages, {key: url for url, key in key_of.items()})


async def generate(
    request: ChatCompletionRequest, chat: PreparedChat, backends: Backends, request_id: str
) -> AsyncIterator[GenerationChunk]:
    """Streams the model's chunks. Errors before the first chunk propagate as-is,
    except a missing key we can re-encode, which is retried once."""
    llm = backends.llm_for(request.model)
    sampling = _sampling(request)
    stream = llm.generate(request.model, chat.messages, sampling, request_id)
    try:
        first = await anext(stream)
    except EmbeddingNotFound as error:
        lost = [key for key in error.keys if key in chat.sources]
        if not lost or len(lost) != len(error.keys):
            raise
        await asyncio.gather(*(backends.encoder.encode(image_url=chat.sources[key]) for key in lost))
        stream = llm.generate(request.model, chat.messages, sampling, request_id)
        first = await anext(stream)
    yield first
    async for chunk in stream:
        yield chunk
