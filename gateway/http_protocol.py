"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol with the two bounds it lacks.

uvicorn times only the wait between requests (keep-alive), not a request itself, and httptools
gathers a header's value for as long as it keeps coming: a 256 MB header was read whole and
answered, and a client that stops halfway through a head or a body held its connection forever.
Here, on every connection:
- the request line and headers of one request may take GATEWAY_MAX_HEADER_BYTES; past that the
  answer is 431 and the connection closes. A head still unfinished is measured by the bytes read
  since it began, after each read is parsed (so a read that holds a small head and a large body
  is never refused for its body); a head that ends within a read, by its parsed parts.
- a request begun (head or body unfinished) on which no byte arrives for
  GATEWAY_REQUEST_READ_TIMEOUT_S is answered 408, if no response has started, and closed.
  Nothing is timed while the request is complete (the app is answering it), while no request is
  open (uvicorn's keep-alive timer owns an idle connection), nor while uvicorn stopped reading.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

import uvicorn
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway import metrics
from gateway.settings import GatewaySettings

logger = logging.getLogger(__name__)
Headers = list[tuple[bytes, bytes]]
# In a request's scope: the status this protocol answered the request with while the app was still
# reading its body (a 408), which the app's own answer, to a closed connection, must not replace.
ANSWERED_BY_PROTOCOL = "gateway.answered_by_protocol"


def _closing_error(message: str, code: str) -> tuple[Headers, bytes]:
    """Headers and body of an answer after which the connection closes, in the OpenAI error shape
    of every other gateway error (gateway.errors), which is out of reach below the app."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return [*headers, (b"connection", b"close")], body


class GatewayHttpProtocol(HttpToolsProtocol):
    # Set per server by `protocol_for`: uvicorn builds one protocol per connection with its own arguments.
    max_header_bytes = 64 * 1024
    read_timeout_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._message_open = False  # the parser is inside a request: its first byte came, its last not yet
        self._head_open = False  # ... inside that request's line and headers
        self._head_bytes = 0  # bytes read since the last request ended (at most one read too few)
        self._read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn starts its keep-alive timer only after a response: a connection that never sent
        # a byte would be held forever. Idle is idle, before the first request or after one.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_open or not self._message_open:
            self._head_bytes += len(data)
        super().data_received(data)
        self._stop_read_timer()
        if self.transport.is_closing():  # uvicorn answered a malformed request, or a handover closed it
            return
        if self._head_open and self._head_bytes > self.max_header_bytes:
            self._refuse(431, *self._head_too_large())
        elif self._message_open:
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    # Parser callbacks, each around uvicorn's own.
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._message_open = self._head_open = True

    def on_headers_complete(self) -> None:
        self._head_open = False
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size <= self.max_header_bytes:
            super().on_headers_complete()
            return
        # uvicorn picks the app that serves this request in on_headers_complete (as it puts its own
        # 503 app there when over limit_concurrency); lend it one that answers 431. The parser goes
        # on through this read, so the request must get a cycle that takes its body.
        app, self.app = self.app, self._answer_head_too_large
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        self._message_open = False
        self._head_bytes = 0
        super().on_message_complete()

    async def _answer_head_too_large(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        message, code = self._head_too_large()
        logger.info("answered 431 to %s: %s", self._peer(), message)  # no summary line: the app never saw it
        metrics.HTTP_REQUESTS.labels(metrics.UNREAD_ROUTE, "431").inc()
        headers, body = _closing_error(message, code)
        await send({"type": "http.response.start", "status": 431, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _head_too_large(self) -> tuple[str, str]:
        return f"request line and headers exceed {self.max_header_bytes} bytes", "headers_too_large"

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self or not self._message_open:
            return
        # uvicorn stopped reading (its buffer is full, or a pipelined request waits for the one
        # before it), or the next request's head waits behind a response still being sent: the
        # silence is not the client's. Looked at again one timeout later.
        if self.flow.read_paused or (self._head_open and self._responding()):
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
            return
        self._refuse(408, f"no byte of the request arrived for {self.read_timeout_s:g} s", "request_timeout")

    def _responding(self) -> bool:
        """Whether a response on this connection has started and not ended."""
        return self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answers `status` unless a response already went out for this request or is still going
        out for the one before (a second head would corrupt it); closes the connection either way."""
        logger.info("closing the connection of %s (%d): %s", self._peer(), status, message)
        started = self.cycle is not None and self.cycle.response_started
        request_answered = started and not self._head_open  # the cycle is this request's once its head ended
        app_reading = self.cycle is not None and not self._head_open and not started
        if app_reading:
            # The app is reading this request's body: it will see the connection close, and its
            # exchange is counted and logged with the status the client got (gateway.exchange).
            cast(dict[str, Any], self.cycle.scope)[ANSWERED_BY_PROTOCOL] = status
        if not request_answered and not self._responding():
            headers, body = _closing_error(message, code)
            headers = [*self.server_state.default_headers, *headers]  # server, date: as on uvicorn's own answers
            lines = [STATUS_LINE[status]] + [name + b": " + value + b"\r\n" for name, value in headers]
            self.transport.write(b"".join([*lines, b"\r\n", body]))
            if not app_reading:  # the app never saw this request, to count it
                metrics.HTTP_REQUESTS.labels(metrics.UNREAD_ROUTE, str(status)).inc()
        self._stop_read_timer()
        self.transport.close()

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None


def protocol_for(settings: GatewaySettings) -> type[GatewayHttpProtocol]:
    """The protocol class with this gateway's limits."""

    class ConfiguredProtocol(GatewayHttpProtocol):
        max_header_bytes = settings.max_header_bytes
        read_timeout_s = settings.request_read_timeout_s

    return ConfiguredProtocol


def uvicorn_config(app: Any, settings: GatewaySettings, **options: Any) -> uvicorn.Config:
    """The uvicorn Config the gateway is served with, by `python -m gateway` and by the tests."""
    return uvicorn.Config(
        app,
        # Our protocol is httptools': never "auto", which falls back silently to h11 (several times
        # the CPU per request and per streamed chunk) where httptools is missing.
        http=protocol_for(settings),
        # uvicorn's hint says int, but it only schedules a timer with it: a float keeps fractions.
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]
        **options,
    )
