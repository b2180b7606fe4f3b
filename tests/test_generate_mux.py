"""GenerateMany: many Generate calls over one stream (llm_service/multiplex.py and
shared/sdk/generate_mux.py), which the gateway uses for every generation.

Against a real LLM service (the test stack's, on its engine) and real gRPC servers: a multiplexed
call gives the tokens, the errors, the cancellation and the deadline that a call of its own gives;
a service that stops refuses new multiplexed calls while those in flight finish; a client whose
token is wrong is refused; a service without GenerateMany (an older version, mid-upgrade) is
served by calls of their own; calls started together leave in one message where the service takes
batches, within the client's message limit, and one call a message where it does not."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
import pytest

from llm_service.multiplex import GenerateManyServicer, MultiplexedStream
from shared.errors import EmbeddingNotFound, ServiceError, Unavailable
from shared.grpc_server import RunningServer, ServerSecurity, start_server
from shared.grpc_subcalls import SubcallChain
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.sdk import AsyncEncoderClient, AsyncLLMClient, ChannelConfig, ImageKey, Message, Sampling
from tests.harness import Stack
from tests.images import png_bytes

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration

QUESTIONS = ["What is this?", "Describe it.", "Which colour?", "How many?", "Where?", "Why so?"]


async def _outcome(llm: AsyncLLMClient, model: str, content: list[object], sampling: Sampling) -> object:
    """What a call gave: its (token ids, finish reason, usage), or its error as (class, message, param)."""
    try:
        chunks = [c async for c in llm.generate(model, [Message("user", content)], sampling)]
    except ServiceError as error:
        return type(error).__name__, str(error), error.param, getattr(error, "keys", None)
    last = chunks[-1]
    return [t for c in chunks for t in c.token_ids], last.finish_reason, last.prompt_tokens, last.completion_tokens


def test_multiplexed_calls_give_the_tokens_and_errors_of_calls_of_their_own(stack: Stack) -> None:
    target = stack.llm_target("ft-a")

    async def run() -> tuple[list[object], list[object]]:
        async with (
            AsyncEncoderClient(stack.encoder_target) as encoder,
            AsyncLLMClient(target) as own,
            AsyncLLMClient(target, multiplex=4) as shared,
        ):
            key = (await encoder.encode(image_bytes=png_bytes(95))).key
            absent = ImageKey(key[:-64] + "0" * 64)
            greedy = Sampling(max_tokens=12)
            cases: list[tuple[list[object], Sampling]] = [([ImageKey(key), q], greedy) for q in QUESTIONS]
            cases += [
                ([absent, "hi"], greedy),  # NOT_FOUND, with the missing key
                (["hi"], Sampling(max_tokens=10**6)),  # INVALID_ARGUMENT, naming the parameter
                ([ImageKey(key), "<|image_pad|>"], greedy),  # INVALID_ARGUMENT from the prompt
            ]
            alone = [await _outcome(own, "ft-a", content, sampling) for content, sampling in cases]
            together = await asyncio.gather(*(_outcome(shared, "ft-a", c, s) for c, s in cases))
            return alone, list(together)

    alone, together = asyncio.run(run())
    assert together == alone
    tokens = [outcome[0] for outcome in alone[: len(QUESTIONS)]]
    assert len({tuple(t) for t in tokens}) > 1, "the questions should give different answers"  # type: ignore[arg-type]
    assert alone[len(QUESTIONS)][0] == EmbeddingNotFound.__name__


def test_a_multiplexed_call_left_early_or_past_its_deadline_stops_in_the_engine(stack: Stack) -> None:
    engine = stack.llms["ft-a"].core.engine
    if not hasattr(engine, "num_unfinished_requests"):
        pytest.skip("ft-a is not served by vLLM here (vLLM not installed)")
    long = Sampling(max_tokens=1990)

    async def leave_early() -> None:
        async with AsyncLLMClient(stack.llm_target("ft-a"), multiplex=4) as llm:
            stream = llm.generate("ft-a", [Message("user", ["tell me everything"])], long)
            await anext(stream)
            await stream.aclose()  # the client goes away after the first chunk
            await _stopped_in_the_engine(engine)

    async def outlast_the_deadline(multiplex: int) -> str:
        async with AsyncLLMClient(stack.llm_target("ft-a"), timeout_s=0.5, multiplex=multiplex) as llm:
            with pytest.raises(ServiceError) as raised:
                [c async for c in llm.generate("ft-a", [Message("user", ["tell me everything"])], long)]
            await _stopped_in_the_engine(engine)
        return type(raised.value).__name__

    asyncio.run(leave_early())
    assert asyncio.run(outlast_the_deadline(4)) == asyncio.run(outlast_the_deadline(0)) == "DeadlineExceeded"


async def _stopped_in_the_engine(engine: object) -> None:
    left_at = time.monotonic()
    while engine.num_unfinished_requests() and time.monotonic() - left_at < 10:  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    assert engine.num_unfinished_requests() == 0  # type: ignore[attr-defined]
    assert time.monotonic() - left_at < 2.0, "the request ran on after its client left"


class HeldLLM(GenerateManyServicer, llm_pb2_grpc.LLMServiceServicer):
    """Answers each Generate with one chunk once `release` is set; serves GenerateMany as the LLM
    service does, through the server's per-call interceptors."""

    def __init__(self, subcalls: SubcallChain) -> None:
        self.subcalls = subcalls
        self.release = asyncio.Event()
        self.started = 0

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.GenerateChunk]:
        self.started += 1
        await self.release.wait()
        yield llm_pb2.GenerateChunk(text=request.request_id, finish_reason=llm_pb2.FINISH_REASON_STOP)


async def _old_generate(
    request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[llm_pb2.GenerateChunk]:
    yield llm_pb2.GenerateChunk(text="old", finish_reason=llm_pb2.FINISH_REASON_STOP)


def _register_an_older_service(server: grpc.aio.Server, _subcalls: SubcallChain) -> None:
    """The service as it was before GenerateMany: Generate only (gRPC answers GenerateMany UNIMPLEMENTED)."""
    generate = grpc.unary_stream_rpc_method_handler(
        _old_generate,
        request_deserializer=llm_pb2.GenerateRequest.FromString,
        response_serializer=llm_pb2.GenerateChunk.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("llm.v1.LLMService", {"Generate": generate}),)
    )


ServicerT = TypeVar("ServicerT", bound=llm_pb2_grpc.LLMServiceServicer)


async def _serve(
    make: Callable[[SubcallChain], ServicerT], token: str | None = None
) -> tuple[RunningServer, ServicerT]:
    made: list[ServicerT] = []

    def register(server: grpc.aio.Server, subcalls: SubcallChain) -> None:
        made.append(make(subcalls))
        llm_pb2_grpc.add_LLMServiceServicer_to_server(made[0], server)

    security = ServerSecurity(token=token)
    running = await start_server(register, ["llm.v1.LLMService"], "127.0.0.1:0", 4 * 1024 * 1024, security)
    return running, made[0]


async def _texts(llm: AsyncLLMClient, request_id: str) -> list[str]:
    return [c.text async for c in llm.generate("m", [Message("user", ["hi"])], request_id=request_id)]


def test_a_stopping_service_finishes_its_multiplexed_calls_and_refuses_new_ones() -> None:
    async def run() -> None:
        running, servicer = await _serve(HeldLLM)
        # One stream: the second call goes on the stream already open, which refuses it; made
        # again on a new stream, it meets the stopped listener, as a call of its own would.
        async with AsyncLLMClient(f"127.0.0.1:{running.port}", multiplex=1) as llm:
            in_flight = asyncio.create_task(_texts(llm, "first"))
            while servicer.started < 1:
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(running.stop(10.0))
            await asyncio.sleep(0.2)
            with pytest.raises(Unavailable):
                await asyncio.wait_for(_texts(llm, "second"), 5)
            assert servicer.started == 1 and not in_flight.done()
            servicer.release.set()
            assert await asyncio.wait_for(in_flight, 5) == ["first"]
            await asyncio.wait_for(stopping, 5)

    asyncio.run(run())


def test_a_multiplexing_client_with_a_wrong_token_is_refused_as_a_call_of_its_own_is() -> None:
    async def run() -> list[str]:
        running, _ = await _serve(HeldLLM, token="right")
        refused = []
        for multiplex in (0, 4):
            config = ChannelConfig(token="wrong")
            async with AsyncLLMClient(f"127.0.0.1:{running.port}", config=config, multiplex=multiplex) as llm:
                with pytest.raises(ServiceError) as raised:
                    await asyncio.wait_for(_texts(llm, "x"), 5)
                refused.append(type(raised.value).__name__)
        await running.stop(0)
        return refused

    assert asyncio.run(run()) == ["Unauthenticated", "Unauthenticated"]


def test_a_service_without_generate_many_is_served_by_calls_of_their_own() -> None:
    async def run() -> list[list[str]]:
        running = await start_server(_register_an_older_service, ["llm.v1.LLMService"], "127.0.0.1:0", 4 * 1024 * 1024)
        async with AsyncLLMClient(f"127.0.0.1:{running.port}", multiplex=4) as llm:
            answers = list(await asyncio.gather(*(_texts(llm, str(i)) for i in range(3))))
            answers.append(await _texts(llm, "later"))
        await running.stop(0)
        return answers

    assert asyncio.run(run()) == [["old"]] * 4


def test_multiplexed_calls_are_spread_over_the_servers_a_target_names() -> None:
    """A headless Service's DNS name gives several pods; gRPC's round_robin gave each call the next
    one. Streams are spread the same way, and calls go to the least busy stream, so each server
    still gets its share (here two servers behind one `ipv4:` target, as DNS would give them)."""

    async def run() -> list[int]:
        servers = [await _serve(HeldLLM) for _ in range(2)]
        target = "ipv4:" + ",".join(f"127.0.0.1:{running.port}" for running, _ in servers)
        async with AsyncLLMClient(target, multiplex=4) as llm:
            with contextlib.suppress(ServiceError):  # connects to both servers before the burst
                await llm.list_models()
            await asyncio.sleep(0.5)
            calls = [asyncio.create_task(_texts(llm, str(i))) for i in range(24)]
            while sum(servicer.started for _, servicer in servers) < len(calls):
                await asyncio.sleep(0.01)
            started = [servicer.started for _, servicer in servers]
            for _, servicer in servers:
                servicer.release.set()
            await asyncio.wait_for(asyncio.gather(*calls), 10)
        for running, _ in servers:
            await running.stop(0)
        return started

    assert asyncio.run(run()) == [12, 12]


@pytest.mark.parametrize("multiplex", [0, 4], ids=["calls of their own", "multiplexed"])
def test_new_calls_go_to_the_other_servers_while_one_drains(multiplex: int) -> None:
    """A rolling update: one pod of a headless Service drains (calls in flight, new ones refused)
    while another serves. Calls of their own stop going to the draining pod at once (it sends
    GOAWAY); multiplexed calls must too, not land on the streams still open to it and fail."""

    async def run() -> tuple[list[list[str]], list[str]]:
        (draining, held), (serving, answering) = [await _serve(HeldLLM) for _ in range(2)]
        answering.release.set()
        target = "ipv4:" + ",".join(f"127.0.0.1:{running.port}" for running in (draining, serving))
        async with AsyncLLMClient(target, multiplex=multiplex) as llm:
            with contextlib.suppress(ServiceError):  # connects to both servers
                await llm.list_models()
            await asyncio.sleep(0.5)
            first = [asyncio.create_task(_texts(llm, f"first {i}")) for i in range(4)]  # two held on each
            while held.started < 2:
                await asyncio.sleep(0.01)
            stopping = asyncio.create_task(draining.stop(10.0))
            await asyncio.sleep(0.2)
            answers = await asyncio.wait_for(asyncio.gather(*(_texts(llm, f"new {i}") for i in range(8))), 10)
            held.release.set()
            firsts = [text for done in await asyncio.wait_for(asyncio.gather(*first), 5) for text in done]
            await asyncio.wait_for(stopping, 5)
        await serving.stop(0)
        return answers, firsts

    answers, firsts = asyncio.run(run())
    assert answers == [[f"new {i}"] for i in range(8)]
    assert sorted(firsts) == [f"first {i}" for i in range(4)]


class CountingLLM(HeldLLM):
    """HeldLLM that counts the GenerateMany messages it reads. `older`: it serves them as a service
    from before MultiplexedCall.batch did: no word of batches in its initial metadata, and the field
    unknown to its parser, so dropped."""

    older = False

    def __init__(self, subcalls: SubcallChain) -> None:
        super().__init__(subcalls)
        self.messages = 0
        self.batches = 0
        self.largest = 0  # bytes of the largest message read

    async def GenerateMany(
        self, calls: AsyncIterator[llm_pb2.MultiplexedCall], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.MultiplexedEvents]:
        async def counted() -> AsyncIterator[llm_pb2.MultiplexedCall]:
            async for message in calls:
                self.messages += 1
                self.batches += bool(message.batch)
                self.largest = max(self.largest, message.ByteSize())
                if self.older:
                    message.ClearField("batch")
                yield message

        if self.older:
            stream = MultiplexedStream(self.subcalls, grpc.unary_stream_rpc_method_handler(self.Generate))
            async for events in stream.serve(counted()):
                yield events
        else:
            async for events in super().GenerateMany(counted(), context):
                yield events


class OlderLLM(CountingLLM):
    older = True


@pytest.mark.parametrize("servicer", [CountingLLM, OlderLLM], ids=["takes batches", "older service"])
def test_calls_started_together_leave_in_one_message_where_the_service_takes_batches(
    servicer: type[CountingLLM],
) -> None:
    """A burst of requests (32 at once through the gateway) would send a message per call; each costs
    both processes a gRPC operation. Batched, the burst is one message; a service from before
    batches gets one call a message, and answers them all."""

    async def run() -> tuple[list[list[str]], int, int]:
        running, counting = await _serve(servicer)
        counting.release.set()
        async with AsyncLLMClient(f"127.0.0.1:{running.port}", multiplex=1) as llm:
            assert await _texts(llm, "first") == ["first"]  # the stream is open, its metadata read
            before = counting.messages
            answers = await asyncio.wait_for(asyncio.gather(*(_texts(llm, str(i)) for i in range(16))), 10)
        await running.stop(0)
        return list(answers), counting.messages - before, counting.batches

    answers, messages, batches = asyncio.run(run())
    assert answers == [[str(i)] for i in range(16)]
    if servicer is OlderLLM:
        assert (messages, batches) == (16, 0)
    else:
        assert (messages, batches) == (1, 1)


@pytest.mark.parametrize(
    ("message", "complaint"),
    [
        (b"\xff\xff\xff\x00 not a MultiplexedCall", "does not parse"),
        (
            llm_pb2.MultiplexedCall(
                call_id=7, batch=[llm_pb2.MultiplexedCall(call_id=1, cancel=True)]
            ).SerializeToString(),
            "nothing else",
        ),
        (
            llm_pb2.MultiplexedCall(
                batch=[llm_pb2.MultiplexedCall(batch=[llm_pb2.MultiplexedCall(call_id=1)])]
            ).SerializeToString(),
            "another batch",
        ),
    ],
    ids=["bytes that do not parse", "an action beside its batch", "a batch in a batch"],
)
def test_a_stream_message_it_cannot_take_ends_the_stream_invalid_argument(message: bytes, complaint: str) -> None:
    async def run() -> tuple[grpc.StatusCode, str]:
        running, _ = await _serve(HeldLLM)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            raw = channel.stream_stream("/llm.v1.LLMService/GenerateMany", lambda b: b, lambda b: b)
            call = raw(iter([message]))
            with pytest.raises(grpc.RpcError):
                async for _ in call:
                    pass
            status = await call.code(), await call.details()
        await running.stop(0)
        return status

    code, details = asyncio.run(run())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and complaint in details


def test_a_start_for_a_call_id_that_is_open_ends_the_stream_not_the_open_call() -> None:
    """The open call keeps its one end (OK), and the stream then ends INVALID_ARGUMENT: an END under
    the id for the second start read as the open call's end, which then ended a second time."""
    start = llm_pb2.MultiplexedCall(call_id=5, start=llm_pb2.GenerateRequest(request_id="first"))
    twice = llm_pb2.MultiplexedCall(batch=[start, start]).SerializeToString()

    async def run() -> tuple[list[llm_pb2.MultiplexedEvent], grpc.StatusCode, str]:
        running, servicer = await _serve(HeldLLM)
        events = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            raw = channel.stream_stream("/llm.v1.LLMService/GenerateMany", lambda b: b, lambda b: b)
            call = raw(iter([twice]))
            servicer.release.set()
            with pytest.raises(grpc.RpcError):
                async for message in call:
                    events += llm_pb2.MultiplexedEvents.FromString(message).events
            status = await call.code(), await call.details()
        await running.stop(0)
        return events, *status

    events, code, details = asyncio.run(run())
    assert [(event.call_id, event.end.code) for event in events if event.HasField("end")] == [(5, 0)]
    assert [event.chunk.text for event in events if event.HasField("chunk")] == ["first"]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "call_id 5 was started while it is open" in details


def test_a_batch_is_no_bigger_than_a_message_the_client_would_send() -> None:
    """A client whose message limit is small (its service's too, as they are set alike) batches
    within it, so a burst does not become one message the service refuses, failing every call."""
    limit = 8 * 1024

    async def run() -> tuple[list[list[str]], int, int]:
        running, counting = await _serve(CountingLLM)
        counting.release.set()
        config = ChannelConfig(max_message_bytes=limit)
        async with AsyncLLMClient(f"127.0.0.1:{running.port}", config=config, multiplex=1) as llm:
            assert await _texts(llm, "first") == ["first"]
            before = counting.messages
            ids = [f"{i}-" + "x" * 1000 for i in range(32)]  # about 1 KB per start
            answers = await asyncio.wait_for(asyncio.gather(*(_texts(llm, i) for i in ids)), 10)
            assert answers == [[i] for i in ids]
        await running.stop(0)
        return list(answers), counting.messages - before, counting.largest

    _, messages, largest = asyncio.run(run())
    assert largest <= limit
    assert 1 < messages < 32
