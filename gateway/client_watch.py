"""Stops serving an HTTP exchange whose client hung up before its response ended.

An ASGI app learns that its client left only by reading `receive` (an `http.disconnect`) or by a
write that fails. Before the response head there is nothing to write: a non-streaming completion
still generating, or a stream still waiting for its first token, ran on for nobody until it ended
(or until the 300 s call deadline), holding engine time and an admission slot.

So, once the request body has been read, one watcher task reads `receive` for the exchange. When
the client leaves before the response ended, it cancels the task serving the exchange, the way
`asyncio.timeout` cancels at a deadline; the cancellation unwinds the handler, which cancels its
gRPC calls on the way out. The app's own later reads (Starlette's streaming response listens for
a disconnect) wait for the watcher's news, so the connection keeps exactly one reader.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType

from starlette.types import Message, Receive

_DISCONNECT: Message = {"type": "http.disconnect"}


class ClientWatch:
    """`async with ClientWatch(receive, response_ended) as watch: await app(scope, watch.receive, send)`.

    The block ends quietly, with `client_left` set, when the client left and cancelled it.
    `response_ended` says whether the last response message went out: uvicorn answers every read
    after that with `http.disconnect` too, and that is no client leaving."""

    def __init__(self, receive: Receive, response_ended: Callable[[], bool]) -> None:
        self._receive = receive
        self._response_ended = response_ended
        self._serving: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._watcher: asyncio.Task[None] | None = None
        self._left = asyncio.Event()
        self._active = False
        self.client_left = False

    async def __aenter__(self) -> ClientWatch:
        self._serving = asyncio.current_task()
        self._cancelling = self._serving.cancelling() if self._serving else 0
        self._active = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._active = False  # first: no cancel may land outside the block
        if self._watcher is not None:
            # Not awaited: an await here could swallow a cancellation of the serving task itself.
            # Let go of it too: the cancelled task keeps its CancelledError, whose traceback holds
            # the watcher's frame, so this watch; were the watch still holding the task, that would
            # be a reference cycle per exchange, keeping the exchange's objects (66) until a
            # collection: in the gateway a full collection of 26 ms, every stream stalled, each
            # ~600 requests on 2 cores.
            self._watcher.cancel()
            self._watcher = None
        if not self.client_left or self._serving is None:
            return False
        # Ours to absorb only if nobody else cancelled the task meanwhile (asyncio.timeout's rule).
        ours_only = self._serving.uncancel() <= self._cancelling
        return ours_only and exc_type is not None and issubclass(exc_type, asyncio.CancelledError)

    async def receive(self) -> Message:
        """The app's `receive`: the request body as sent, then `http.disconnect` once the client left."""
        if self._watcher is not None:
            await self._left.wait()
            return _DISCONNECT
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self._watcher = asyncio.create_task(self._watch())
        return message

    async def _watch(self) -> None:
        # After the body, uvicorn's `receive` answers only `http.disconnect` (client gone or response ended).
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._left.set()
        if self._active and not self._response_ended() and self._serving is not None:
            self.client_left = True
            self._serving.cancel()
