"""The request id of the call being served, and structured JSON logs that carry it.

The gateway takes (or makes) `x-request-id`, sends it to the services as gRPC
metadata, and every log line written while serving that request names it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time
from typing import Any

import grpc

from shared.grpc_wrap import StreamBehavior, UnaryBehavior, WrappingInterceptor

REQUEST_ID_KEY = "x-request-id"
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, request_id, exception."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(service: str, level: str, json_logs: bool) -> None:
    """Called once, in each service's __main__."""
    handler = logging.StreamHandler()
    if json_logs:
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


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
