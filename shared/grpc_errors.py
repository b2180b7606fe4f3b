"""The one place where domain errors become gRPC statuses, and statuses become errors again.

Servers install `ErrorMappingInterceptor`; clients call `error_from_rpc`. The
error's `code`, `param` and missing keys travel in trailing metadata so the
gateway can rebuild the exact error class (and re-encode on a missing key).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from shared.errors import (
    DeadlineExceeded,
    EmbeddingNotFound,
    Internal,
    InvalidInput,
    ServiceError,
    Unavailable,
    error_class_for,
)
from shared.grpc_wrap import Deserializer, WrappingInterceptor

logger = logging.getLogger(__name__)

CODE_KEY = "error-code"
PARAM_KEY = "error-param"
MISSING_KEYS_KEY = "missing-keys"


def trailing_metadata_for(error: ServiceError) -> tuple[tuple[str, str], ...]:
    metadata = [(CODE_KEY, error.code)]
    if error.param:
        metadata.append((PARAM_KEY, error.param))
    if isinstance(error, EmbeddingNotFound):
        metadata.append((MISSING_KEYS_KEY, ",".join(error.keys)))
    return tuple(metadata)


async def _abort(context: grpc.aio.ServicerContext, error: ServiceError) -> None:
    context.set_trailing_metadata(trailing_metadata_for(error))
    await context.abort(error.kind.grpc_code, error.message)


async def _answer_cancellation(context: grpc.aio.ServicerContext) -> bool:
    """A call whose work was cancelled. When grpc cancelled the call itself (its client hung up,
    its deadline passed, the server is stopping), this task was asked to cancel and nobody waits
    for an answer: the cancellation goes on (True). When work the call awaited was cancelled under
    it (an engine shutting down), grpc would end the call without a status and the client would
    wait for its deadline: it is answered Unavailable (503, retry), the service is going away."""
    task = asyncio.current_task()
    if task is None or task.cancelling() > 0:
        return True
    await _abort(context, Unavailable("the service stopped this call (it is shutting down); retry"))
    return False


async def _answer(context: grpc.aio.ServicerContext, error: BaseException, kind: str) -> bool:
    """The one mapping from what a servicer raised to the call's status, for unary and streaming
    RPCs alike. Called from inside the `except` block, so the log keeps the traceback.

    True: `error` goes on as it is, and the caller re-raises it with a bare `raise`. Raising it
    here would add this frame, which holds `error`, to the error's own traceback: a reference
    cycle per failed or cancelled call, everything the call held kept until a collection."""
    if isinstance(error, grpc.aio.AbortError):  # context.abort() already set the status
        return True
    if isinstance(error, ServiceError):
        await _abort(context, error)
    elif isinstance(error, asyncio.CancelledError):
        return await _answer_cancellation(context)
    else:
        logger.exception("unhandled error in %s RPC", kind)
        await _abort(context, Internal("internal error; see the service log"))
    return False


@dataclass(frozen=True)
class _Undecodable:
    """Stands for request bytes that are not the method's message. grpc answers a deserializer that
    raises with UNKNOWN, a server fault; bytes a client sent wrong are its mistake, so the call
    goes on with this and is answered INVALID_ARGUMENT inside the error mapping."""

    error: str


def _tolerant(deserializer: Deserializer) -> Deserializer:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as error:  # protobuf's only parse error: corrupt wire format, bad UTF-8
            return _Undecodable(str(error))

    return parse


def _decoded(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise InvalidInput(f"the request message does not parse: {request.error}")
    return request


def _wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(_decoded(request), context)
        except (Exception, asyncio.CancelledError) as error:
            if await _answer(context, error, "unary"):
                raise

    return wrapper


def _wrap_stream(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def wrapper(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in behavior(_decoded(request), context):
                yield item
        # Not GeneratorExit: a closed stream must close, not be answered.
        except (Exception, asyncio.CancelledError) as error:
            if await _answer(context, error, "streaming"):
                raise

    return wrapper


class ErrorMappingInterceptor(WrappingInterceptor):
    """Turns ServiceError into its status code, a request message that does not parse into
    INVALID_ARGUMENT, and anything else into INTERNAL (logged)."""

    def __init__(self) -> None:
        super().__init__(_wrap_unary, _wrap_stream, _tolerant)


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item_key, value in metadata or ():
        if item_key == key:
            return value if isinstance(value, str) else value.decode()
    return None


def error_from_rpc(error: grpc.RpcError, target: str = "backend") -> ServiceError:
    """Rebuilds the domain error a server raised (or a transport failure) from an RpcError."""
    status = error.code()
    details = error.details() or status.name
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else ()
    code = _metadata_value(metadata, CODE_KEY)
    param = _metadata_value(metadata, PARAM_KEY)
    # CANCELLED reaches a caller only when the server cancelled the call (a caller that cancels
    # reads nothing more): the server is going away, as after its engine died or its drain ended.
    # Like a lost connection, that is a 503 the client may retry, not a server bug.
    if code is None and status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return Unavailable(f"{target} is unavailable: {details}")
    if code is None and status == grpc.StatusCode.DEADLINE_EXCEEDED:  # the caller's deadline passed
        return DeadlineExceeded(f"{target} did not answer within the call's deadline: {details}")
    cls = error_class_for(status, code)
    if cls is EmbeddingNotFound:
        keys = (_metadata_value(metadata, MISSING_KEYS_KEY) or "").split(",")
        return EmbeddingNotFound(details, keys=[k for k in keys if k], param=param)
    if cls is Internal and code is None:
        return Internal(f"{target} failed: {status.name}: {details}")
    return cls(details, param=param)


@contextmanager
def raising_service_errors(target: str) -> Iterator[None]:
    """Client side: `with raising_service_errors("encoder at host:port"): ...` turns RpcError into ServiceError."""
    try:
        yield
    except grpc.RpcError as error:
        raise error_from_rpc(error, target) from None
