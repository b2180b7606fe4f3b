"""Prometheus metrics of every gRPC call a server handles, and the /metrics HTTP endpoint."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from shared.grpc_wrap import StreamBehavior, UnaryBehavior, rewrap

RPC_HANDLED = Counter(
    "grpc_server_handled_total", "RPCs completed, by method and status code.", ["grpc_method", "grpc_code"]
)
RPC_SECONDS = Histogram(
    "grpc_server_handling_seconds", "Time from call start to its last message, by method.", ["grpc_method"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)  # fmt: skip
RPC_IN_FLIGHT = Gauge("grpc_server_in_flight", "RPCs being served now, by method.", ["grpc_method"])


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return "OK"
    # A stream whose client went away ends either way: its task is cancelled, or gRPC closes the
    # generator (GeneratorExit) when it can no longer write.
    return "CANCELLED" if isinstance(error, asyncio.CancelledError | GeneratorExit) else "UNKNOWN"


class _Observed:
    def __init__(self, method: str, context: grpc.aio.ServicerContext) -> None:
        self.method, self.context = method, context

    def __enter__(self) -> None:
        self.started = time.perf_counter()
        RPC_IN_FLIGHT.labels(self.method).inc()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        RPC_IN_FLIGHT.labels(self.method).dec()
        RPC_SECONDS.labels(self.method).observe(time.perf_counter() - self.started)
        RPC_HANDLED.labels(self.method, _code(self.context, error)).inc()


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method

        def wrap_unary(behavior: UnaryBehavior) -> UnaryBehavior:
            async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with _Observed(method, context):
                    return await behavior(request, context)

            return wrapper

        def wrap_stream(behavior: StreamBehavior) -> StreamBehavior:
            async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
                with _Observed(method, context):
                    async for item in behavior(request, context):
                        yield item

            return wrapper

        return rewrap(await continuation(handler_call_details), wrap_unary, wrap_stream)


def serve_metrics(port: int) -> None:
    """Serves /metrics on `port` from a background thread (0 = off)."""
    if port:
        start_http_server(port)
