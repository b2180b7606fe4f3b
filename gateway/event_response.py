"""The response of a streamed chat completion: server-sent events, sent as they are made."""

from __future__ import annotations

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStreamResponse(StreamingResponse):
    """Starlette's StreamingResponse without its own disconnect listener.

    Under uvicorn (ASGI spec 2.3), Starlette runs each stream in a task group beside a task that
    reads `receive` until the client disconnects. The gateway's ExchangeMiddleware already has one
    reader per exchange (gateway.client_watch.ClientWatch), which cancels the serving task when the
    client leaves, so that listener only ever waited on the watcher, and its task group and task
    were a cost paid on every stream, on the event loop that relays every other stream's tokens.
    """

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream_response(send)
        if self.background is not None:
            await self.background()
