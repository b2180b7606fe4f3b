"""Calls that arrive inside another call (a multiplexed stream), served exactly as calls of
their own: through the server's interceptors (drain count, request context, tracing, metrics,
error mapping), with a context that keeps the status they end with.

A server that multiplexes many calls over one stream must not grow a second copy of what the
interceptors do per call (request ids in logs, spans, the status metrics, the one error mapping):
each inner call is resolved through the same interceptor objects, with its own metadata, and its
behaviour is run with `SubcallContext` in place of grpc's context.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class _CallDetails:
    """What an interceptor learns about a call (grpc.HandlerCallDetails)."""

    method: str
    invocation_metadata: Metadata


class SubcallContext:
    """The part of grpc.aio.ServicerContext that our interceptors and servicers use, for a call
    that is not a gRPC call of its own. `abort` records the status and raises AbortError, as
    grpc's does; `code`, `details` and `trailing_metadata` give the status the call ended with."""

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self.trailing_metadata: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        return self._metadata

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing_metadata = tuple(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Metadata = ()) -> None:
        self._code, self._details = code, details
        if trailing_metadata:
            self.trailing_metadata = tuple(trailing_metadata)
        raise grpc.aio.AbortError()


Continuation = Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]]


class SubcallChain:
    """The server's per-call interceptors, outermost first (not the token check: the stream that
    carries the calls passed it), applied to a handler for one inner call at a time."""

    def __init__(self, interceptors: Sequence[grpc.aio.ServerInterceptor]) -> None:
        self._interceptors = tuple(interceptors)
        self.open = True  # False once the server drains: new inner calls are refused as new calls are

    def close(self) -> None:
        self.open = False

    async def resolve(self, method: str, metadata: Metadata, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` wrapped as the interceptors wrap a call of `method` with `metadata`."""
        resolved = await self._continuation(0, handler)(_CallDetails(method, metadata))
        assert resolved is not None  # our interceptors wrap a handler; none drops it
        return resolved

    def _continuation(self, index: int, handler: grpc.RpcMethodHandler) -> Continuation:
        """What interceptor `index` calls to go on: the next one, or past the last, `handler`. A
        method, not a closure calling itself: that is a reference cycle per call, left to the
        garbage collector."""

        async def continuation(details: Any) -> grpc.RpcMethodHandler | None:
            if index == len(self._interceptors):
                return handler
            return await self._interceptors[index].intercept_service(self._continuation(index + 1, handler), details)

        return continuation
