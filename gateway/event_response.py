"""The response of a streamed chat completion: server-sent events, sent as they are made."""

from __future__ import annotations

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class LastEvents(str):
    """The stream's last events (its [DONE]): they go out in one write with the response's end,
    the chunked encoding's terminator, which Starlette sends as a write of its own."""


class EventStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse without its own disconnect listener, ending in one write.

    Under uvicorn (ASGI spec 2.3), Starlette runs each stream in a task group beside a task that
    reads `receive` until the client disconnects. The gateway's ExchangeMiddleware already has one
    reader per exchange (gateway.client_watch.ClientWatch), which cancels the serving task when the
    client leaves, so that listener only ever waited on the watcher, and its task group and task
    were a cost paid on every stream, on the event loop that relays every other stream's tokens.

    Each body message is a send through every ASGI layer and a syscall: the body iterator marks
    its last piece (LastEvents), which is sent as the response's last message.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream_response(send)
        if self.background is not None:
            await self.background()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for events in self.body_iterator:
            body = events if isinstance(events, bytes | memoryview) else events.encode(self.charset)
            ended = isinstance(events, LastEvents)
            await send({"type": "http.response.body", "body": body, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
