"""The outermost layer of every HTTP exchange, in plain ASGI.

Plain ASGI, not `@app.middleware("http")`: an exception escaping that middleware is answered by
Starlette's ServerErrorMiddleware, outside it, without our headers; and it sees a request only
once its endpoint returned, so it can neither count body bytes nor know when a stream ended.
Here, for each exchange:
- a request id, taken from `x-request-id` or made up, is stamped on every response head;
- API keys and the body limit are checked before any route runs. The limit is counted on the
  bytes received, not on `Content-Length`, which a chunked body does not send;
- an exception nobody answered becomes the OpenAI-shaped 500;
- the request id is in force for every log line written while serving it, the request's trace
  span (shared.tracing) for every call made for it, and one summary line (gateway.summary) is
  written when the exchange ends, with the status its client got (`_status`);
- a client that hangs up before its response ended stops the serving of it (gateway.client_watch);
- cleanups registered with `on_exchange_end` (an admission slot, an open generation) run once
  when the exchange ends: response sent, failed, or never started because the client left.
"""

from __future__ import annotations

import inspect
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence

from starlette.requests import ClientDisconnect, Request
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics, summary
from gateway.access import ApiKeys
from gateway.client_watch import ClientWatch
from gateway.errors import error_response
from gateway.http_protocol import ANSWERED_BY_PROTOCOL
from shared import tracing
from shared.errors import Internal, ServiceError, TooLarge
from shared.request_context import request_id_var

logger = logging.getLogger(__name__)
Cleanup = Callable[[], object]  # may return an awaitable, which is awaited
_CLEANUPS = "exchange_cleanups"
# A client's id is echoed in headers and logs: only a short token of safe characters is kept.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# nginx's code for "client closed the request": the exchange ended before any response head.
CLIENT_GONE = 499


def on_exchange_end(request: Request, cleanup: Cleanup) -> None:
    """Runs `cleanup` once when this HTTP exchange ends, however it ends."""
    request.scope["state"][_CLEANUPS].append(cleanup)


class _Response:
    """The response side of one exchange. Once the gateway answered by itself (the body limit),
    whatever the app still sends is dropped: the client already has its answer."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self._request_id = request_id.encode()
        self.status: int | None = None
        self.head_at: float | None = None
        self.ended = False  # the last message of the response went out
        self._closed = False

    async def send(self, message: Message) -> None:
        if self._closed:
            return
        if message["type"] == "http.response.start":
            self.status, self.head_at = message["status"], time.perf_counter()
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", self._request_id)]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def answer(self, error: ServiceError, scope: Scope, receive: Receive) -> None:
        """Sends `error` unless a response head went out already; ends the response either way."""
        if self.status is None:
            await error_response(error)(scope, receive, self.send)
        self._closed = True


class ExchangeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: ApiKeys,
        max_body_bytes: int,
        open_paths: tuple[str, ...],
        routes: Sequence[BaseRoute] = (),
    ) -> None:
        self.app = app
        self._routes = routes  # the app's, to name a request answered before its route ran
        self._api_keys = api_keys
        self._max_body_bytes = max_body_bytes
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request = Request(scope)
        client_id = request.headers.get("x-request-id", "")
        request.state.request_id = client_id if _CLIENT_ID.fullmatch(client_id) else uuid.uuid4().hex
        setattr(request.state, _CLEANUPS, [])
        response = _Response(send, request.state.request_id)
        # Every line logged while serving this request names it (shared.logging_setup).
        request_id_token = request_id_var.set(request.state.request_id)
        watched = not request.url.path.startswith(self._open_paths)  # probes and scrapes: no trace, no line
        with (
            summary.summarised() as noted,
            tracing.http_server_span(scope["method"], scope["path"], request.headers, record=watched) as span,
        ):
            body = _BodyReader(receive, response, scope, self._max_body_bytes)
            try:
                self._admit(request)
                async with ClientWatch(body.receive, lambda: response.ended) as watch:
                    await self.app(scope, watch.receive, response.send)
                if watch.client_left:
                    logger.info("client went away from %s; stopped serving it", scope["path"])
            except ClientDisconnect:
                logger.info("client went away from %s", scope["path"])
            except ServiceError as error:
                await response.answer(error, scope, receive)
            except Exception:
                logger.exception("unhandled error on %s", scope["path"])
                await response.answer(Internal("internal error; see the gateway log"), scope, receive)
            finally:
                await _run_cleanups(getattr(request.state, _CLEANUPS))
                route = self._route_of(scope)
                status = self._status(scope, response, body.cut)
                metrics.HTTP_SECONDS.labels(route).observe((response.head_at or time.perf_counter()) - started)
                metrics.HTTP_REQUESTS.labels(route, str(status)).inc()
                if watched:
                    summary.log_summary(noted, scope["method"], route, status)
                    attributes = {tracing.MODEL: noted.model or "", tracing.MEDIA_KEYS: noted.keys}
                    tracing.end_http_span(span, scope["method"], route, status, attributes)
                request_id_var.reset(request_id_token)

    def _route_of(self, scope: Scope) -> str:
        """The path template a request is counted and logged under. The router sets the route it
        ran; a request answered before routing (a 401, a 413 by Content-Length) is matched here,
        or its count would go under "unmatched" with the unknown paths'."""
        route = scope.get("route")
        if route is None:
            route = next((r for r in self._routes if r.matches(scope)[0] == Match.FULL), None)
        return str(getattr(route, "path", "unmatched"))

    def _admit(self, request: Request) -> None:
        if not request.url.path.startswith(self._open_paths):
            self._api_keys.check(request.headers.get("authorization"))
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > self._max_body_bytes:
            raise _too_large(self._max_body_bytes)

    @staticmethod
    def _status(scope: Scope, response: _Response, body_cut: bool) -> int:
        """The status an exchange is counted and logged with: what its client got. A request whose
        body never came whole got no answer from the app (the framework answers the cut body 400,
        to a closed connection): 499, or the protocol's own answer (a 408 for a body that stopped)."""
        if body_cut:
            return int(scope.get(ANSWERED_BY_PROTOCOL, CLIENT_GONE))
        return response.status or CLIENT_GONE


class _BodyReader:
    """`receive` for the app: answers 413 as soon as the body passes the limit (counted on the bytes
    received, not on Content-Length) and stops the app reading; notes a body cut short (`cut`: the
    connection closed before its last byte)."""

    def __init__(self, receive: Receive, response: _Response, scope: Scope, max_body_bytes: int) -> None:
        self._receive, self._response, self._scope = receive, response, scope
        self._max_body_bytes = max_body_bytes
        self._received = 0
        self._complete = False
        self.cut = False

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            self._complete = not message.get("more_body", False)
            if self._received > self._max_body_bytes:
                error = _too_large(self._max_body_bytes)
                await self._response.answer(error, self._scope, self._receive)
                raise error
        elif message["type"] == "http.disconnect" and not self._complete:
            self.cut = True
        return message


def _too_large(max_body_bytes: int) -> TooLarge:
    return TooLarge(f"request body exceeds {max_body_bytes} bytes")


async def _run_cleanups(cleanups: list[Cleanup]) -> None:
    for cleanup in cleanups:
        try:
            result = cleanup()
            if inspect.isawaitable(result):
                await result
        except Exception:  # one failed cleanup must not skip the others (an admission slot among them)
            logger.exception("cleanup %r failed", cleanup)
