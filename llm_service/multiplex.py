"""GenerateMany: many Generate calls over one stream (proto/llm/v1/llm.proto).

Why: a gRPC call of its own costs each side about 0.7 ms of CPU to set up and end, and each
message on its own stream about 0.06 ms more (`python -m bench.grpc_cost`); the gateway makes one
call per chat completion and relays one message per token. Over one stream, the calls cost no
set-up, and the chunks that one engine step makes for every call leave in one message.

Each call is served exactly as a Generate call of its own: a task runs the servicer's Generate
through the server's per-call interceptors (shared/grpc_subcalls.py: drain count, request id,
trace span, metrics, the error mapping), so its chunks, its errors and its metrics are those of
Generate. Its chunks and its final status go out as events, in order per call. Calls started
together may come as one message (`MultiplexedCall.batch`, which the stream's initial metadata
says it takes), taken in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.message import DecodeError

from shared.grpc_subcalls import SubcallChain, SubcallContext
from shared.pb.llm.v1 import llm_pb2
from shared.sdk.generate_mux import BATCHING_METADATA, take_waiting

logger = logging.getLogger(__name__)

GENERATE_METHOD = "/llm.v1.LLMService/Generate"
# A message of events stops taking more once this big; one event alone may be bigger (a completion
# held for single_chunk goes out in pieces of up to 4 MiB), as it is as a Generate message.
MAX_EVENTS_BYTES = 1 << 20
_END_OF_EVENTS = None


class ProtocolViolation(ValueError):
    """A message the stream cannot take: a batch that also carries an action of its own, a batch
    within its batch, or a start for a call_id that is open (its events could not be told apart)."""


def _actions(message: llm_pb2.MultiplexedCall) -> Sequence[llm_pb2.MultiplexedCall]:
    """The actions a message carries, in order: itself, or its batch."""
    if not message.batch:
        return (message,)
    if message.call_id or message.WhichOneof("action") or message.metadata:
        raise ProtocolViolation(
            "a GenerateMany message with a batch must carry nothing else (its actions are in `batch`)"
        )
    if any(action.batch for action in message.batch):
        raise ProtocolViolation("a GenerateMany batch must not hold another batch")
    return message.batch


def _status(code: grpc.StatusCode, details: str = "", trailing: tuple[tuple[str, str], ...] = ()) -> llm_pb2.CallStatus:
    return llm_pb2.CallStatus(code=code.value[0], details=details, trailing_metadata=dict(trailing))


class MultiplexedStream:
    """One GenerateMany stream: the calls it started, and the events they make, in order."""

    def __init__(self, subcalls: SubcallChain, generate: grpc.RpcMethodHandler) -> None:
        self._subcalls = subcalls
        self._generate = generate
        self._calls: dict[int, asyncio.Task[None]] = {}
        self._events: asyncio.Queue[llm_pb2.MultiplexedEvent | None] = asyncio.Queue()
        self._reading = True
        self.refusal: str | None = None  # why the caller's messages stopped being read, if they did not end well
        # What came when the last message was full (the end of events among them): at most one.
        self._held: list[llm_pb2.MultiplexedEvent | None] = []

    async def serve(self, calls: AsyncIterator[llm_pb2.MultiplexedCall]) -> AsyncIterator[llm_pb2.MultiplexedEvents]:
        """The stream's messages until its caller stopped writing and every call ended."""
        reader = asyncio.create_task(self._read(calls))
        try:
            async for message in self._messages():
                yield message
        finally:  # the stream ended or broke: nobody is left to take an answer
            reader.cancel()
            tasks = [reader, *self._calls.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, messages: AsyncIterator[llm_pb2.MultiplexedCall]) -> None:
        try:
            async for message in messages:
                for call in _actions(message):
                    if call.HasField("start"):
                        self._start(call)
                    elif call.cancel and call.call_id in self._calls:
                        self._calls[call.call_id].cancel()
        except DecodeError as error:  # the calls open go on; the stream then ends INVALID_ARGUMENT
            self.refusal = f"a message on the GenerateMany stream does not parse: {error}"
        except ProtocolViolation as error:
            self.refusal = str(error)
        finally:
            self._reading = False
            self._end_if_idle()

    def _start(self, call: llm_pb2.MultiplexedCall) -> None:
        if call.call_id in self._calls:  # an END under its id would read as the open call's end
            raise ProtocolViolation(f"GenerateMany call_id {call.call_id} was started while it is open")
        if not self._subcalls.open:  # draining: refused as a new Generate call would be, and
            # marked as never begun, so that the client makes it on a stream to another server
            refusal = _status(grpc.StatusCode.UNAVAILABLE, "the service is shutting down")
            refusal.not_started = True
            self._put_end(call.call_id, refusal)
        else:
            metadata = tuple(call.metadata.items())
            task = asyncio.create_task(self._run(call.call_id, call.start, metadata))
            self._calls[call.call_id] = task
            # A callback, not a `finally`: a task cancelled before it first ran never runs its body.
            task.add_done_callback(functools.partial(self._forget, call.call_id))

    async def _run(self, call_id: int, request: llm_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...]) -> None:
        context = SubcallContext(metadata)
        end: llm_pb2.CallStatus | None = None
        try:
            handler = await self._subcalls.resolve(GENERATE_METHOD, metadata, self._generate)
            async for chunk in handler.unary_stream(request, context):
                self._events.put_nowait(llm_pb2.MultiplexedEvent(call_id=call_id, chunk=chunk))
            end = _status(grpc.StatusCode.OK)
        except grpc.aio.AbortError:  # the error mapping set the status, as for a call of its own
            code = context.code() or grpc.StatusCode.UNKNOWN
            end = _status(code, context.details(), context.trailing_metadata)
        except asyncio.CancelledError:
            pass  # its caller cancelled it, or the stream ended: nobody waits for its end
        except Exception:  # the error mapping answers everything; this is a bug of ours
            logger.exception("multiplexed Generate call failed outside the error mapping")
            end = _status(grpc.StatusCode.INTERNAL, "internal error; see the service log")
        if end is not None:
            self._put_end(call_id, end)

    def _forget(self, call_id: int, _task: asyncio.Task[None]) -> None:
        del self._calls[call_id]
        self._end_if_idle()

    def _put_end(self, call_id: int, status: llm_pb2.CallStatus) -> None:
        self._events.put_nowait(llm_pb2.MultiplexedEvent(call_id=call_id, end=status))

    def _end_if_idle(self) -> None:
        if not self._reading and not self._calls:
            self._events.put_nowait(_END_OF_EVENTS)

    async def _messages(self) -> AsyncIterator[llm_pb2.MultiplexedEvents]:
        """The events as they come, each message holding all that are ready, up to MAX_EVENTS_BYTES
        (or one event alone, however big)."""
        while True:
            first = self._held.pop() if self._held else await self._events.get()
            if first is _END_OF_EVENTS:
                return
            events = take_waiting(first, self._events, self._held, MAX_EVENTS_BYTES)
            yield llm_pb2.MultiplexedEvents(events=events)


class GenerateManyServicer:
    """GenerateMany for a servicer that has Generate and the server's SubcallChain: put it before
    the generated servicer base class, whose GenerateMany only answers UNIMPLEMENTED."""

    subcalls: SubcallChain

    def Generate(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.GenerateChunk]:
        raise NotImplementedError

    async def GenerateMany(
        self, calls: AsyncIterator[llm_pb2.MultiplexedCall], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.MultiplexedEvents]:
        await context.send_initial_metadata((BATCHING_METADATA,))
        stream = MultiplexedStream(self.subcalls, grpc.unary_stream_rpc_method_handler(self.Generate))
        async for message in stream.serve(calls):
            yield message
        if stream.refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, stream.refusal)
