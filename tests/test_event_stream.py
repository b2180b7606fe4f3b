"""How a streamed chat completion is cut into body writes (gateway/openai_format.py event_stream,
gateway/event_response.py): each write is a send through every ASGI layer and a syscall, so the
events made ready together go out together, and the stream's end goes out in one write with its
last events. The events themselves are checked end to end with the openai client
(tests/test_openai_api.py, tests/test_end_to_end.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from starlette.types import Message

from gateway.event_response import EventStreamResponse, LastEvents
from gateway.openai_format import event_stream
from shared.sdk import GenerationChunk


def _chunk(text: str, finish_reason: str | None = None, completion_tokens: int = 0) -> GenerationChunk:
    return GenerationChunk(text, [1], finish_reason, 5, completion_tokens)


async def _indexed(chunks: list[tuple[int, GenerationChunk]]) -> AsyncIterator[tuple[int, GenerationChunk]]:
    for item in chunks:
        yield item


def _events(piece: str) -> list[str]:
    return [event.removeprefix("data: ") for event in piece.split("\n\n") if event]


async def _pieces(n: int, chunks: list[tuple[int, GenerationChunk]], include_usage: bool = False) -> list[str]:
    return [piece async for piece in event_stream("id", "ft-a", n, _indexed(chunks), include_usage)]


def _deltas(piece: str) -> list[tuple[int, dict, str | None] | str]:
    """Each event of a piece: (index, delta, finish_reason), "usage" or "[DONE]"."""
    described: list[tuple[int, dict, str | None] | str] = []
    for event in _events(piece):
        if event == "[DONE]":
            described.append(event)
            continue
        body = json.loads(event)
        if not body["choices"]:
            described.append("usage")
        for choice in body["choices"]:
            described.append((choice["index"], choice["delta"], choice["finish_reason"]))
    return described


def test_the_last_chunk_its_finish_and_done_leave_in_the_last_write() -> None:
    chunks = [(0, _chunk("Hel")), (0, _chunk("lo")), (0, _chunk("!", "stop", 3))]
    pieces = asyncio.run(_pieces(1, chunks, include_usage=True))
    assert [_deltas(piece) for piece in pieces] == [
        [(0, {"role": "assistant", "content": ""}, None), (0, {"content": "Hel"}, None)],
        [(0, {"content": "lo"}, None)],
        [(0, {"content": "!"}, None), (0, {}, "stop"), "usage", "[DONE]"],
    ]
    assert isinstance(pieces[-1], LastEvents) and not any(isinstance(piece, LastEvents) for piece in pieces[:-1])


def test_a_choice_that_finished_first_goes_out_while_another_still_streams() -> None:
    chunks = [(0, _chunk("a")), (1, _chunk("b", "length", 1)), (0, _chunk("c")), (0, _chunk("d", "stop", 3))]
    pieces = asyncio.run(_pieces(2, chunks))
    assert [_deltas(piece) for piece in pieces] == [
        [(0, {"role": "assistant", "content": ""}, None), (1, {"role": "assistant", "content": ""}, None),
         (0, {"content": "a"}, None)],
        [(1, {"content": "b"}, None), (1, {}, "length")],
        [(0, {"content": "c"}, None)],
        [(0, {"content": "d"}, None), (0, {}, "stop"), "[DONE]"],
    ]  # fmt: skip


async def _sent(pieces: list[str]) -> list[Message]:
    """The ASGI messages EventStreamResponse sends for a body iterator yielding `pieces`."""
    messages: list[Message] = []

    async def body() -> AsyncIterator[str]:
        for piece in pieces:
            yield piece

    async def send(message: Message) -> None:
        messages.append(message)

    async def receive() -> Message:
        raise AssertionError("the response never reads the request")

    await EventStreamResponse(body())({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return messages


def test_the_response_ends_with_its_last_events_not_in_a_write_of_its_own() -> None:
    sent = asyncio.run(_sent(["data: 1\n\n", LastEvents("data: [DONE]\n\n")]))
    assert [message["type"] for message in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert [(message["body"], message["more_body"]) for message in sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"data: [DONE]\n\n", False),
    ]


def test_a_body_without_last_events_still_ends_the_response() -> None:
    sent = asyncio.run(_sent(["data: 1\n\n"]))
    assert [(message["body"], message["more_body"]) for message in sent[1:]] == [
        (b"data: 1\n\n", True),
        (b"", False),
    ]
