"""Prometheus metrics of every gRPC call a server handles, and the /metrics HTTP endpoint.

Labels follow go-grpc-prometheus, which gRPC dashboards and alerts are written against:
`grpc_service` (llm.v1.LLMService), `grpc_type` (unary, server_stream, ...) and `grpc_code`.
`grpc_method` keeps the full path (/llm.v1.LLMService/Generate) it has always had here, so existing
queries still match; group by `grpc_service` for the per-service view.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from shared.grpc_wrap import within

_CALL = ["grpc_service", "grpc_method", "grpc_type"]
RPC_HANDLED = Counter("grpc_server_handled_total", "RPCs completed, by method and status code.", [*_CALL, "grpc_code"])
RPC_SECONDS = Histogram(
    "grpc_server_handling_seconds", "Time from call start to its last message, by method.", _CALL,
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)  # fmt: skip
RPC_IN_FLIGHT = Gauge("grpc_server_in_flight", "RPCs being served now, by method.", _CALL)
MESSAGES_SENT = Counter("grpc_server_msg_sent_total", "Messages sent by the server's streams, by method.", _CALL)


def rpc_type(handler: grpc.RpcMethodHandler) -> str:
    """go-grpc-prometheus's name for the handler's kind of call."""
    if handler.request_streaming:
        return "bidi_stream" if handler.response_streaming else "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def call_labels(method: str, handler: grpc.RpcMethodHandler) -> tuple[str, str, str]:
    """(grpc_service, grpc_method, grpc_type) of a call to `method` ("/package.Service/Method")."""
    service = method.lstrip("/").rpartition("/")[0]
    return service, method, rpc_type(handler)


def status_name(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The call's final status code name, as its client sees it."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return "OK"
    # A stream whose client went away ends either way: its task is cancelled, or gRPC closes the
    # generator (GeneratorExit) when it can no longer write.
    return "CANCELLED" if isinstance(error, asyncio.CancelledError | GeneratorExit) else "UNKNOWN"


class _Observed:
    def __init__(self, labels: tuple[str, str, str], context: grpc.aio.ServicerContext) -> None:
        self.labels, self.context = labels, context

    def __enter__(self) -> None:
        self.started = time.perf_counter()
        RPC_IN_FLIGHT.labels(*self.labels).inc()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        RPC_IN_FLIGHT.labels(*self.labels).dec()
        RPC_SECONDS.labels(*self.labels).observe(time.perf_counter() - self.started)
        RPC_HANDLED.labels(*self.labels, status_name(self.context, error)).inc()


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        # Client-streaming calls are not observed (`within` wraps only unary-request ones): the one
        # such RPC, GenerateMany, carries calls that are counted each as the Generate it stands for.
        if handler is None or handler.request_streaming:
            return handler
        labels = call_labels(handler_call_details.method, handler)
        return within(handler, lambda context: _Observed(labels, context), MESSAGES_SENT.labels(*labels).inc)


def serve_metrics(port: int) -> None:
    """Serves /metrics on `port` from a background thread (0 = off)."""
    if port:
        start_http_server(port)
