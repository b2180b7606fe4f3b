"""Generate calls multiplexed over GenerateMany streams (proto/llm/v1/llm.proto), client side.

Each call is started, read and cancelled as a Generate call of its own would be, and ends the
same way: its chunks, then either nothing (OK) or a `MultiplexedCallError`, an RpcError with the
status and trailing metadata Generate would have ended with, so callers map it to the same domain
error (shared.grpc_errors.error_from_rpc). When the stream breaks (the service died, the connection
dropped), every call open on it fails with the stream's status, as calls on that connection would.

A service that is shutting down refuses new calls on its open streams, marked as never begun (a
rolling update: its pod drains while others serve). The stream then takes no more calls, and the
refused call is made on another stream, as gRPC would send a call of its own to another pod once
the draining one said GOAWAY.

Calls started together leave in one message (`MultiplexedCall.batch`) once the service said in its
stream's initial metadata that it takes them so: each message on a stream costs both processes a
gRPC operation, and a burst of requests would otherwise send one per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc

# A stream takes new calls for this long, then the next call opens a new one and the old one ends
# with its last call. A new stream goes where the channel's round_robin sends it: to a pod added
# since (servers age connections out, shared.grpc_server.MAX_CONNECTION_AGE_MS, so that clients
# re-resolve), or to one that was not ready yet when the first streams opened. Opening a stream
# costs about what one call of its own does, so this is a small price.
ROTATE_S = 10.0
# In a GenerateMany stream's initial metadata: the service takes MultiplexedCall.batch.
BATCHING_METADATA = ("llm-multiplex-batch", "1")
# A batch stops taking more actions once this big, or the client's message limit if smaller (a
# batch is no bigger than a message the client would send anyway); one action alone may be bigger
# (a start with an inline embedding), as it is when sent alone.
MAX_BATCH_BYTES = 1 << 20
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
ProtoT = TypeVar("ProtoT", bound=Message)


class MultiplexedCallError(grpc.RpcError):
    """A multiplexed call that did not end OK, shaped as the RpcError of a call of its own."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailing: Sequence[tuple[str, str]] = (),
        of_stream: bool = False,
        not_started: bool = False,
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailing = code, details, tuple(trailing)
        self.of_stream = of_stream  # the GenerateMany stream's own status, not the call's end
        self.not_started = not_started  # refused before it began: safe to make again elsewhere

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


class MultiplexUnsupported(Exception):
    """The service has no GenerateMany (a version before it, as during a rolling upgrade). Raised
    before the call reached the service: it is safe to make it as a call of its own."""


_Arrival = llm_pb2.GenerateChunk | MultiplexedCallError | None  # None: the call ended OK


def _ending(status: llm_pb2.CallStatus) -> MultiplexedCallError | None:
    code = _STATUS_CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    if code == grpc.StatusCode.OK:
        return None
    trailing = tuple(status.trailing_metadata.items())
    return MultiplexedCallError(code, status.details, trailing, not_started=status.not_started)


def take_waiting(
    first: ProtoT, waiting: asyncio.Queue[ProtoT | None], held: list[ProtoT | None], max_bytes: int
) -> list[ProtoT]:
    """`first` and the messages waiting behind it, in order, while their sizes add up to at most
    `max_bytes` (`first` alone may be bigger). The first one that does not fit, or the end (None),
    goes into `held`, to come first next time. Both ends of GenerateMany batch so."""
    taken, size = [first], first.ByteSize()
    while not waiting.empty():
        item = waiting.get_nowait()
        if item is None or size + (item_size := item.ByteSize()) > max_bytes:
            held.append(item)
            break
        taken.append(item)
        size += item_size
    return taken


class _Stream:
    """One GenerateMany call: a writer task sends starts and cancels in order, a reader task hands
    each event to its call's queue."""

    def __init__(
        self, stub: llm_pb2_grpc.LLMServiceStub, metadata: tuple[tuple[str, str], ...], max_batch_bytes: int
    ) -> None:
        self._rpc = stub.GenerateMany(metadata=metadata)
        self._max_batch_bytes = max_batch_bytes
        self.opened = time.monotonic()
        self.calls: dict[int, asyncio.Queue[_Arrival]] = {}
        self.failure: MultiplexedCallError | None = None  # set once the stream broke or ended
        self._retired = False
        self._outbox: asyncio.Queue[llm_pb2.MultiplexedCall | None] = asyncio.Queue()
        self._batching = False  # whether the service said it takes batches; until then, one action a message
        self._held: list[llm_pb2.MultiplexedCall | None] = []  # what did not fit the last batch
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())
        self._listener = asyncio.create_task(self._learn_batching())

    @property
    def taking_calls(self) -> bool:
        return self.failure is None and not self._retired

    def start(
        self, call_id: int, request: llm_pb2.GenerateRequest, metadata: dict[str, str]
    ) -> asyncio.Queue[_Arrival]:
        queue: asyncio.Queue[_Arrival] = asyncio.Queue()
        if self.failure is not None:
            queue.put_nowait(self.failure)
            return queue
        self.calls[call_id] = queue
        self._outbox.put_nowait(llm_pb2.MultiplexedCall(call_id=call_id, start=request, metadata=metadata))
        return queue

    def cancel(self, call_id: int) -> None:
        """Stops a call nobody reads any more; the service cancels its generation."""
        if self.calls.pop(call_id, None) is not None and self.failure is None:
            self._outbox.put_nowait(llm_pb2.MultiplexedCall(call_id=call_id, cancel=True))
        self._end_if_done()

    def retire(self) -> None:
        """Takes no new calls; the stream ends once its open calls have."""
        self._retired = True
        self._end_if_done()

    async def close(self) -> None:
        """Cancels the stream; its open calls end CANCELLED, as calls of a closed channel do."""
        self._rpc.cancel()
        for task in (self._writer, self._reader, self._listener):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, self._listener, return_exceptions=True)
        self._fail_open_calls(MultiplexedCallError(grpc.StatusCode.CANCELLED, "the client was closed", of_stream=True))

    def _fail_open_calls(self, failure: MultiplexedCallError) -> None:
        self.failure = self.failure or failure
        calls, self.calls = self.calls, {}
        for queue in calls.values():
            queue.put_nowait(failure)

    def _end_if_done(self) -> None:
        if self._retired and not self.calls:
            self._outbox.put_nowait(None)

    async def _learn_batching(self) -> None:
        # Not awaited by the writer: a service before batching sends its initial metadata only
        # with its first answer, and calls must not wait for that.
        with contextlib.suppress(grpc.RpcError, asyncio.InvalidStateError):
            self._batching = BATCHING_METADATA in tuple(await self._rpc.initial_metadata() or ())

    async def _write(self) -> None:
        try:
            while (message := await self._next_message()) is not None:
                await self._rpc.write(message)
            await self._rpc.done_writing()
        except (grpc.RpcError, asyncio.InvalidStateError):
            pass  # the stream broke: the reader reports how, to every open call

    async def _next_message(self) -> llm_pb2.MultiplexedCall | None:
        """The next action, or, where the service takes batches, every action waiting (up to
        its max_batch_bytes) as one batch; None once the stream should end."""
        first = self._held.pop() if self._held else await self._outbox.get()
        if first is None or not self._batching or self._outbox.empty():
            return first
        actions = take_waiting(first, self._outbox, self._held, self._max_batch_bytes)
        return actions[0] if len(actions) == 1 else llm_pb2.MultiplexedCall(batch=actions)

    async def _read(self) -> None:
        try:
            async for message in self._rpc:
                for event in message.events:
                    self._deliver(event)
            failure = MultiplexedCallError(
                grpc.StatusCode.UNAVAILABLE, "the service ended the multiplexed stream", of_stream=True
            )
        except grpc.RpcError as error:  # grpc.aio.AioRpcError: the stream's own status
            trailing = tuple(error.trailing_metadata() or ()) if isinstance(error, grpc.aio.AioRpcError) else ()
            failure = MultiplexedCallError(error.code(), error.details() or error.code().name, trailing, True)
        self._writer.cancel()
        self._fail_open_calls(failure)

    def _deliver(self, event: llm_pb2.MultiplexedEvent) -> None:
        if event.HasField("chunk"):
            queue = self.calls.get(event.call_id)
            if queue is not None:  # else cancelled meanwhile
                queue.put_nowait(event.chunk)
            return
        if event.end.not_started:  # its service is shutting down: it would refuse every new call
            self._retired = True
        queue = self.calls.pop(event.call_id, None)
        if queue is not None:
            queue.put_nowait(_ending(event.end))
        self._end_if_done()


class GenerateMultiplexer:
    """The Generate calls of one client, over `streams` GenerateMany streams at a time.

    Several streams, not one: a target that names several servers (a headless Service's pods)
    spreads calls over them by the channel's round_robin, one server per call. Streams are
    spread the same way, one server per stream, and each call goes to the stream with the fewest
    calls open, so the servers share the calls as they did. A target with more servers than
    `streams` leaves the extra ones without calls until streams rotate."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        stream_metadata: tuple[tuple[str, str], ...],
        call_metadata: Callable[[], dict[str, str]] | None = None,
        streams: int = 1,
        max_message_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be at least 1 (got {streams})")
        self._stub = llm_pb2_grpc.LLMServiceStub(channel)
        self._max_batch_bytes = min(MAX_BATCH_BYTES, max_message_bytes)
        self._stream_metadata = stream_metadata
        self._call_metadata = call_metadata  # e.g. the caller's trace context (ChannelConfig.call_metadata)
        self._streams: list[_Stream | None] = [None] * streams
        self._turn = 0  # where the search for the least busy stream starts: ties go round
        self._retired: set[_Stream] = set()
        self._call_ids = itertools.count(1)

    async def generate(
        self, request: llm_pb2.GenerateRequest, request_id: str | None, timeout_s: float | None
    ) -> AsyncGenerator[llm_pb2.GenerateChunk, None]:
        """The call's chunks; raises MultiplexedCallError as it ends, unless it ended OK. Past
        `timeout_s` (None: no deadline) it is cancelled and ends DEADLINE_EXCEEDED, as a call with
        that deadline."""
        metadata = self._call_metadata() if self._call_metadata is not None else {}
        if request_id:
            metadata["x-request-id"] = request_id
        stream, call_id = self._pick(), next(self._call_ids)
        queue = stream.start(call_id, request, metadata)
        # A timer that queues the deadline's error: `asyncio.timeout` cannot span a generator's
        # yields (it would cancel whatever its consumer does at that moment). It reads `queue` when
        # it fires: the queue of the stream the call is on by then.
        deadline: MultiplexedCallError | None = MultiplexedCallError(
            grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        )
        timer = (
            None
            if timeout_s is None
            else asyncio.get_running_loop().call_later(timeout_s, lambda: queue.put_nowait(deadline))
        )
        # Each refusal retires a stream, so after one per stream the call is on a fresh one.
        refusals_left = len(self._streams)
        ended = False
        try:
            while (arrival := await queue.get()) is not None:
                if isinstance(arrival, MultiplexedCallError):
                    ended = arrival is not deadline
                    if arrival.not_started and refusals_left:  # its server is draining: another one
                        refusals_left -= 1
                        stream, call_id = self._pick(), next(self._call_ids)
                        queue = stream.start(call_id, request, metadata)
                        ended = False
                        continue
                    if arrival.of_stream and arrival.code() == grpc.StatusCode.UNIMPLEMENTED:
                        raise MultiplexUnsupported()
                    raise arrival
                yield arrival
            ended = True
        finally:
            if timer is not None:
                timer.cancel()
            if not ended:
                stream.cancel(call_id)
            # The error raised holds this frame in its traceback, and this frame holds the error:
            # let go of it, or the two are a reference cycle, left to the garbage collector.
            arrival = deadline = None

    async def close(self) -> None:
        streams = [*self._retired, *(stream for stream in self._streams if stream is not None)]
        self._streams, self._retired = [None] * len(self._streams), set()
        await asyncio.gather(*(stream.close() for stream in streams))

    def _pick(self) -> _Stream:
        """The stream with the fewest calls open (a slot without a live stream counts as none),
        opening a new one in its slot when it has none, broke, was refused, or took calls for ROTATE_S."""
        count = len(self._streams)
        order = [(self._turn + step) % count for step in range(count)]
        slot = min(order, key=lambda i: len(s.calls) if (s := self._streams[i]) is not None else 0)
        self._turn = (slot + 1) % count
        stream = self._streams[slot]
        if stream is not None and stream.taking_calls and time.monotonic() - stream.opened < ROTATE_S:
            return stream
        if stream is not None:
            stream.retire()
            self._retired = {s for s in self._retired if s.failure is None} | {stream}
        fresh = self._streams[slot] = _Stream(self._stub, self._stream_metadata, self._max_batch_bytes)
        return fresh
