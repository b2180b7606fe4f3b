"""Each RPC is written once, as a plan both clients run: the blocking and the async client of a
service differ only in how they wait, so request building, metadata, error mapping and the
conversion of replies live here and in the per-method plans, never in a client method."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Self, TypeVar

from google.protobuf.message import Message as ProtoMessage

from shared.errors import Unavailable
from shared.grpc_auth import call_metadata
from shared.grpc_errors import raising_service_errors
from shared.sdk.types import ChannelConfig

ReplyT = TypeVar("ReplyT")
ResultT = TypeVar("ResultT")

# gRPC cannot hold a deadline much past 1e9 s from now: a call given a longer timeout (or inf)
# ends at once with DEADLINE_EXCEEDED. A timeout longer than this one (three years) is no deadline.
MAX_TIMEOUT_S = 1e8


def call_timeout(timeout_s: float | None) -> float | None:
    """The deadline of each call, in seconds from its start; None: none. A client's `timeout_s`
    is read here only: None, inf or anything past MAX_TIMEOUT_S means no deadline; zero, a
    negative number or NaN is a ValueError (every call would fail at once with DEADLINE_EXCEEDED,
    which reads as a slow service)."""
    if timeout_s is None:
        return None
    if not timeout_s > 0:  # also NaN
        raise ValueError(f"timeout_s must be a positive number of seconds, or None for no deadline (got {timeout_s!r})")
    return None if timeout_s > MAX_TIMEOUT_S else float(timeout_s)


@dataclass(frozen=True)
class Call(Generic[ReplyT, ResultT]):
    """One RPC as data: the stub method to call, its request, and what the reply (for a streaming
    RPC: each message) becomes in the SDK's types."""

    rpc: str  # the stub's method name, e.g. "Encode"
    request: ProtoMessage
    result: Callable[[ReplyT], ResultT]
    request_id: str | None = None  # sent as x-request-id, so the services' logs name it


# A generated stub class (`encoder_pb2_grpc.EncoderServiceStub`): built from a channel.
StubType = Callable[[Any], object]


class _Client:
    """Where a client calls and how: target, deadline, channel settings, the service's stub, and
    the words its errors name the service by (`ServiceError`s say "encoder at host:port")."""

    _aio: ClassVar[bool]  # a grpc.aio channel, or a blocking one

    def __init__(
        self, service: str, stub_type: StubType, target: str, timeout_s: float | None, config: ChannelConfig | None
    ) -> None:
        self.target = target
        self.timeout_s = call_timeout(timeout_s)
        self._config = config or ChannelConfig()
        self._errors = f"{service} at {target}"
        self._channel = self._config.open(target, aio=self._aio)
        self._stub = stub_type(self._channel)

    def _invoke(self, call: Call[Any, Any]) -> Any:
        """Starts the call: the reply (blocking), an awaitable of it (async) or the message stream."""
        method = getattr(self._stub, call.rpc)
        return method(call.request, timeout=self.timeout_s, metadata=call_metadata(self._config.token, call.request_id))


class BlockingClient(_Client):
    """Base of the blocking clients: runs plans and waits on a plain gRPC channel."""

    _aio = False

    def _unary(self, call: Call[Any, ResultT]) -> ResultT:
        with raising_service_errors(self._errors):
            reply = self._invoke(call)
        return call.result(reply)

    def _stream(self, call: Call[Any, ResultT]) -> Generator[ResultT, None, None]:
        """The stream's messages as results; leaving the loop early cancels the call on the server."""
        stream = self._invoke(call)
        try:
            with raising_service_errors(self._errors):
                for message in stream:
                    yield call.result(message)
        finally:
            stream.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Client):
    """Base of the async clients: runs the same plans on a grpc.aio channel."""

    _aio = True
    _closed = False

    async def _unary(self, call: Call[Any, ResultT]) -> ResultT:
        with raising_service_errors(self._errors), self._closed_under_call():
            reply = await self._invoke(call)
        return call.result(reply)

    async def _stream(self, call: Call[Any, ResultT]) -> AsyncGenerator[ResultT, None]:
        """The stream's messages as results; leaving the loop early cancels the call on the server."""
        stream = self._invoke(call)
        try:
            with raising_service_errors(self._errors), self._closed_under_call():
                async for message in stream:
                    yield call.result(message)
        finally:
            stream.cancel()

    @contextmanager
    def _closed_under_call(self) -> Iterator[None]:
        """grpc.aio ends the calls open on a channel being closed with asyncio.CancelledError, in
        tasks nobody cancelled: a caller's `except ServiceError` missed it, and its task ended as
        if cancelled. Such a call fails Unavailable, as it does on the blocking client and when
        multiplexed (its words: "the client was closed"); a task that is being cancelled still is."""
        try:
            yield
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self._closed or task is None or task.cancelling():
                raise
            raise Unavailable(f"{self._errors} is unavailable: the client was closed") from None

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
