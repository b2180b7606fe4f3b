"""OpenAI response, chunk and error shapes, and server-sent-event framing."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from gateway.errors import error_body
from gateway.event_response import LastEvents
from gateway.openai_logprobs import logprobs_body
from shared.errors import Internal, ServiceError
from shared.sdk import GenerationChunk, TokenLogprob

logger = logging.getLogger(__name__)
IndexedChunks = AsyncIterator[tuple[int, GenerationChunk]]


class _Usage:
    """Prompt tokens once (every choice shares the prompt); completion tokens summed."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, last: GenerationChunk) -> None:
        self.prompt_tokens = last.prompt_tokens
        self.completion_tokens += last.completion_tokens

    def as_dict(self) -> dict[str, int]:
        total = self.prompt_tokens + self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": total}


async def completion(completion_id: str, model: str, n: int, chunks: IndexedChunks) -> dict[str, Any]:
    """Collects all choices' streams into one chat.completion object."""
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    usage = _Usage()
    async for index, chunk in chunks:
        texts[index].append(chunk.text)
        logprobs[index] += chunk.logprobs
        if chunk.finish_reason is not None:
            finish[index] = chunk.finish_reason
            usage.add(chunk)
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": "".join(texts[i])},
            "finish_reason": finish[i],
            "logprobs": logprobs_body(logprobs[i]),
        }
        for i in range(n)
    ]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage.as_dict(),
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def event_stream(
    completion_id: str, model: str, n: int, chunks: IndexedChunks, include_usage: bool
) -> AsyncIterator[str]:
    """chat.completion.chunk events: each choice's role first and finish_reason last, an
    optional usage chunk (empty choices), then [DONE]. An error after the first event
    becomes an error event, then [DONE].

    Events made ready together go out as one body write: the role events with the first chunk's,
    a chunk's content with its finish_reason. Once every choice has finished, what is left waits
    for the end of the stream (which comes with the last chunk) and goes out with the usage chunk,
    [DONE] and the response's end, as the last write (LastEvents). Each write is a send through
    every ASGI layer and a syscall, the gateway's main cost per token; an SSE client reads events,
    however they were cut into writes."""
    created = int(time.time())
    usage = _Usage()

    def frame(choices: list[dict[str, Any]], **extra: Any) -> str:
        return _sse(
            {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
        )

    def choice(
        index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Sequence[TokenLogprob] = ()
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs_body(logprobs)}

    ready = [frame([choice(index, {"role": "assistant", "content": ""})]) for index in range(n)]
    unfinished = n
    try:
        async for index, chunk in chunks:
            # Tokens of an incomplete character come with no text, but their logprobs still go out.
            if chunk.text or chunk.logprobs:
                ready.append(frame([choice(index, {"content": chunk.text}, logprobs=chunk.logprobs)]))
            if chunk.finish_reason is not None:
                usage.add(chunk)
                ready.append(frame([choice(index, {}, chunk.finish_reason)]))
                unfinished -= 1
            if ready and unfinished:
                yield "".join(ready)
                ready = []
        if include_usage:
            ready.append(frame([], usage=usage.as_dict()))
    except ServiceError as error:
        ready.append(_sse(error_body(error)))
    except Exception:  # a bug must still end the stream properly, not cut the connection
        logger.exception("unexpected error while streaming %s", completion_id)
        ready.append(_sse(error_body(Internal("internal error; see the gateway log"))))
    ready.append("data: [DONE]\n\n")
    yield LastEvents("".join(ready))
