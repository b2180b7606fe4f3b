"""OpenAI response, chunk and error shapes, and server-sent-event framing."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from shared.errors import ServiceError
from shared.sdk import GenerationChunk


def error_body(error: ServiceError) -> dict[str, Any]:
    return {"error": {"message": error.message, "type": error.kind.openai_type, "param": error.param, "code": error.code}}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


async def completion(completion_id: str, model: str, chunks: AsyncIterator[GenerationChunk]) -> dict[str, Any]:
    """Collects a whole stream into one chat.completion object."""
    text, last = [], None
    async for chunk in chunks:
        text.append(chunk.text)
        last = chunk
    assert last is not None and last.finish_reason is not None, "a generation always ends with a finish chunk"
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(text)},
                "finish_reason": last.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(last.prompt_tokens, last.completion_tokens),
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def event_stream(
    completion_id: str, model: str, chunks: AsyncIterator[GenerationChunk], include_usage: bool
) -> AsyncIterator[str]:
    """chat.completion.chunk events: role first, finish_reason last, optional usage, then [DONE].
    An error after the first chunk becomes an error event, then [DONE]."""
    created = int(time.time())

    def frame(delta: dict[str, Any], finish_reason: str | None) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]})

    yield frame({"role": "assistant", "content": ""}, None)
    try:
        async for chunk in chunks:
            if chunk.text:
                yield frame({"content": chunk.text}, None)
            if chunk.finish_reason is not None:
                yield frame({}, chunk.finish_reason)
                if include_usage:
                    usage = _usage(chunk.prompt_tokens, chunk.completion_tokens)
                    yield _sse({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage})
    except ServiceError as error:
        yield _sse(error_body(error))
    yield "data: [DONE]\n\n"
