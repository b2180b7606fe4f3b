"""Re-wrapping a gRPC method handler's behaviour, for server interceptors that act
around each call (error mapping, request context, metrics)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

import grpc

UnaryBehavior = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]
# Made per call from its context; entered as the call starts, left as it ends, with the error it
# ended with (a stream's client going away ends it with CancelledError or GeneratorExit).
CallScope = Callable[[grpc.aio.ServicerContext], AbstractContextManager[Any]]
Deserializer = Callable[[bytes], Any]


def rewrap(
    handler: grpc.RpcMethodHandler | None,
    wrap_unary: Callable[[UnaryBehavior], UnaryBehavior],
    wrap_stream: Callable[[StreamBehavior], StreamBehavior],
    wrap_deserializer: Callable[[Deserializer], Deserializer] | None = None,
) -> grpc.RpcMethodHandler | None:
    """The same handler with its unary-unary or unary-stream behaviour (and, if given, its request
    deserializer) wrapped; others as they are."""
    if handler is None:
        return None
    deserializer = handler.request_deserializer
    if wrap_deserializer is not None and deserializer is not None:
        deserializer = wrap_deserializer(deserializer)
    serializers = {
        "request_deserializer": deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **serializers)
    if handler.unary_stream:
        # A streaming behaviour either yields its messages (our servicers) or writes them with
        # context.write() and returns (grpc's own health Watch); the latter is awaited like a unary one.
        behavior = handler.unary_stream
        wrapped = wrap_stream(behavior) if inspect.isasyncgenfunction(behavior) else wrap_unary(behavior)
        return grpc.unary_stream_rpc_method_handler(wrapped, **serializers)
    return handler


def within(
    handler: grpc.RpcMethodHandler | None, scope: CallScope, each_message: Callable[[], None] = lambda: None
) -> grpc.RpcMethodHandler | None:
    """The same handler with every call, unary or streamed, run inside `scope(context)`, and
    `each_message()` called as a stream yields each of its messages."""

    def wrap_unary(behavior: UnaryBehavior) -> UnaryBehavior:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with scope(context):
                return await behavior(request, context)

        return wrapper

    def wrap_stream(behavior: StreamBehavior) -> StreamBehavior:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with scope(context):
                async for item in behavior(request, context):
                    each_message()
                    yield item

        return wrapper

    return rewrap(handler, wrap_unary, wrap_stream)


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Applies `wrap_unary` / `wrap_stream` around the behaviour of every call (and
    `wrap_deserializer` around its request deserializer)."""

    def __init__(
        self,
        wrap_unary: Callable[[UnaryBehavior], UnaryBehavior],
        wrap_stream: Callable[[StreamBehavior], StreamBehavior],
        wrap_deserializer: Callable[[Deserializer], Deserializer] | None = None,
    ) -> None:
        self._wrap_unary = wrap_unary
        self._wrap_stream = wrap_stream
        self._wrap_deserializer = wrap_deserializer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        return rewrap(handler, self._wrap_unary, self._wrap_stream, self._wrap_deserializer)
