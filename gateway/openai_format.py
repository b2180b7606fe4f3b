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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


class _Usage:
    """Prompt tokens once (every choice shares the prompt); completion tokens summed."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def add(self, last: GenerationChunk) -> None:
        self.prompt_tokens = last.prompt_tokens
        self.completion_tokens += last.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return _usage(self.prompt_tokens, self.completion_tokens)


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


def _choice(
    index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Sequence[TokenLogprob] = ()
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs_body(logprobs)}


class _Frames:
    """One stream's chat.completion.chunk events, as SSE text. With continuous usage (vLLM's
    stream_options.continuous_usage_stats) every event of a choice carries the usage so far, as
    vLLM's do: the prompt's tokens, and that choice's completion tokens so far (0 in its role event)."""

    def __init__(self, completion_id: str, model: str, continuous_usage: bool) -> None:
        self._head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        self._continuous_usage = continuous_usage

    def roles(self, n: int, prompt_tokens: int) -> list[str]:
        usage = _usage(prompt_tokens, 0) if self._continuous_usage else None
        return [self._frame([_choice(index, {"role": "assistant", "content": ""})], usage) for index in range(n)]

    def content(self, index: int, chunk: GenerationChunk) -> str:
        return self._frame([_choice(index, {"content": chunk.text}, logprobs=chunk.logprobs)], self._so_far(chunk))

    def finish(self, index: int, chunk: GenerationChunk) -> str:
        return self._frame([_choice(index, {}, chunk.finish_reason)], self._so_far(chunk))

    def usage(self, usage: _Usage) -> str:
        """The usage chunk (include_usage): no choices, every choice's tokens."""
        return self._frame([], usage.as_dict())

    def _so_far(self, chunk: GenerationChunk) -> dict[str, int] | None:
        return _usage(chunk.prompt_tokens, chunk.completion_tokens) if self._continuous_usage else None

    def _frame(self, choices: list[dict[str, Any]], usage: dict[str, int] | None) -> str:
        payload = {**self._head, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return _sse(payload)


async def event_stream(
    completion_id: str, model: str, n: int, chunks: IndexedChunks, include_usage: bool, continuous_usage: bool = False
) -> AsyncIterator[str]:
    """chat.completion.chunk events: each choice's role first and finish_reason last, an
    optional usage chunk (empty choices), then [DONE]. An error after the first event
    becomes an error event, then [DONE]. continuous_usage: usage so far on every event (_Frames).

    Events made ready together go out as one body write: the role events with the first chunk's,
    a chunk's content with its finish_reason. Once every choice has finished, what is left waits
    for the end of the stream (which comes with the last chunk) and goes out with the usage chunk,
    [DONE] and the response's end, as the last write (LastEvents). Each write is a send through
    every ASGI layer and a syscall, the gateway's main cost per token; an SSE client reads events,
    however they were cut into writes."""
    frames, usage = _Frames(completion_id, model, continuous_usage), _Usage()
    ready: list[str] = []
    started = False  # the role events are made with the first chunk, which tells the prompt's tokens
    unfinished = n
    try:
        async for index, chunk in chunks:
            if not started:
                ready, started = frames.roles(n, chunk.prompt_tokens), True
            # Tokens of an incomplete character come with no text, but their logprobs still go out.
            if chunk.text or chunk.logprobs:
                ready.append(frames.content(index, chunk))
            if chunk.finish_reason is not None:
                usage.add(chunk)
                ready.append(frames.finish(index, chunk))
                unfinished -= 1
            if ready and unfinished:
                yield "".join(ready)
                ready = []
        if include_usage:
            ready.append(frames.usage(usage))
    except ServiceError as error:
        ready.append(_sse(error_body(error)))
    except Exception:  # a bug must still end the stream properly, not cut the connection
        logger.exception("unexpected error while streaming %s", completion_id)
        ready.append(_sse(error_body(Internal("internal error; see the gateway log"))))
    if not started:  # no chunk came: the role events still open the choices
        ready[:0] = frames.roles(n, 0)
    ready.append("data: [DONE]\n\n")
    yield LastEvents("".join(ready))
