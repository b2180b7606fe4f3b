"""The request id of the call being served.

The gateway takes (or makes) `x-request-id`, sends it to the services as gRPC
metadata, and every log line written while serving that request names it
(shared.logging_setup reads it from request_id_var).
"""

from __future__ import annotations

import contextvars
from typing import Any

import grpc

from shared.grpc_wrap import StreamBehavior, UnaryBehavior, WrappingInterceptor

REQUEST_ID_KEY = "x-request-id"
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def _request_id(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def _wrap_unary(behavior: UnaryBehavior) -> UnaryBehavior:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        request_id_var.set(_request_id(context))
        return await behavior(request, context)

    return wrapper


def _wrap_stream(behavior: StreamBehavior) -> StreamBehavior:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        request_id_var.set(_request_id(context))
        async for item in behavior(request, context):
            yield item

    return wrapper


class RequestContextInterceptor(WrappingInterceptor):
    """Puts the caller's x-request-id into request_id_var for the duration of the call."""

    def __init__(self) -> None:
        super().__init__(_wrap_unary, _wrap_stream)
