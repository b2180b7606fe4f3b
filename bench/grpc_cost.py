"""gRPC's own CPU cost per streamed request, and what one multiplexed stream would save.

Issue 12's fixed cost per request is mostly our extra hop's CPU, and on a 2-core CPU host every
millisecond of it is taken from the engine. This measures the gRPC part alone, with nothing of ours
in between: two processes on loopback, a server that streams `messages` small messages per request
(one every `step_ms`, as an engine step yields a token), and a client that runs `rounds` bursts of
`concurrency` requests in one of two ways:
- calls: one unary-stream call per request, what the gateway and an LLM service do today;
- mux: one bidi stream for everything, each server message carrying one token of every request
  in the burst (the multiplexed design the stop 27 note proposes).
Reported: CPU ms per request of the server and of the client process, from /proc (Linux).

    python -m bench.grpc_cost [--messages 17] [--concurrency 32] [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from google.protobuf.struct_pb2 import ListValue

from bench.cpu import process_cpu_seconds
from scripts.ports import free_port

SERVICE = "bench.GrpcCost"


@dataclass(frozen=True)
class Load:
    messages: int  # per request: 17 for a 16-token answer (one per token, then the last)
    concurrency: int
    rounds: int
    step_ms: float


def _strings(values: list[str]) -> ListValue:
    message = ListValue()
    for value in values:
        message.values.add().string_value = value
    return message


def _serialize(message: ListValue) -> bytes:
    return message.SerializeToString()


def _handlers(load: Load) -> grpc.GenericRpcHandler:
    async def per_request(request: ListValue, context: grpc.aio.ServicerContext) -> AsyncIterator[ListValue]:
        for index in range(load.messages):
            await asyncio.sleep(load.step_ms / 1000)
            yield _strings([f"token {index}"])

    async def multiplexed(
        bursts: AsyncIterator[ListValue], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ListValue]:
        async for burst in bursts:  # the request ids of one burst
            ids = [value.string_value for value in burst.values]
            for index in range(load.messages):
                await asyncio.sleep(load.step_ms / 1000)
                yield _strings([f"{request_id} token {index}" for request_id in ids])

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "PerRequest": grpc.unary_stream_rpc_method_handler(
                per_request, request_deserializer=ListValue.FromString, response_serializer=_serialize
            ),
            "Multiplexed": grpc.stream_stream_rpc_method_handler(
                multiplexed, request_deserializer=ListValue.FromString, response_serializer=_serialize
            ),
        },
    )


async def serve(port: int, load: Load) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((_handlers(load),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("serving", flush=True)
    await server.wait_for_termination()


async def _calls(channel: grpc.aio.Channel, load: Load, rounds: int) -> None:
    call = channel.unary_stream(
        f"/{SERVICE}/PerRequest", request_serializer=_serialize, response_deserializer=ListValue.FromString
    )

    async def one() -> None:
        received = 0
        async for _ in call(_strings(["question"])):
            received += 1
        assert received == load.messages

    for _ in range(rounds):
        await asyncio.gather(*(one() for _ in range(load.concurrency)))


async def _mux(channel: grpc.aio.Channel, load: Load, rounds: int) -> None:
    stream = channel.stream_stream(
        f"/{SERVICE}/Multiplexed", request_serializer=_serialize, response_deserializer=ListValue.FromString
    )()
    for burst in range(rounds):
        ids = [f"r{burst}-{index}" for index in range(load.concurrency)]
        await stream.write(_strings(ids))
        # Demultiplexed as a gateway would: each token to its request's queue.
        queues: dict[str, asyncio.Queue[str]] = {request_id: asyncio.Queue() for request_id in ids}
        for _ in range(load.messages):
            message = await stream.read()
            assert isinstance(message, ListValue)
            for value in message.values:
                request_id, _, token = value.string_value.partition(" ")
                queues[request_id].put_nowait(token)
        assert all(queue.qsize() == load.messages for queue in queues.values())
    await stream.done_writing()


async def measure(port: int, server_pid: int, load: Load) -> dict[str, dict[str, float]]:
    """{"calls" | "mux": {"server ms": .., "client ms": ..}} per request, after one unmeasured round."""
    results: dict[str, dict[str, float]] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        for name, run in (("calls", _calls), ("mux", _mux)):
            await run(channel, load, 1)
            server_before, client_before = process_cpu_seconds(server_pid), time.process_time()
            await run(channel, load, load.rounds)
            requests = load.rounds * load.concurrency
            results[name] = {
                "server ms": (process_cpu_seconds(server_pid) - server_before) * 1000 / requests,
                "client ms": (time.process_time() - client_before) * 1000 / requests,
            }
    return results


def run(load: Load) -> dict[str, dict[str, float]]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.grpc_cost", "--serve", str(port), *_load_args(load)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        # The wait is a statement of its own: inside an assert, `python -O` would skip it.
        first_line = server.stdout.readline().strip() if server.stdout is not None else ""
        if first_line != "serving":
            raise RuntimeError(f"the gRPC cost server did not start (it printed {first_line!r})")
        return asyncio.run(measure(port, server.pid, load))
    finally:
        server.kill()
        server.wait()


def _load_args(load: Load) -> list[str]:
    return ["--messages", str(load.messages), "--concurrency", str(load.concurrency), "--rounds", str(load.rounds),
            "--step-ms", str(load.step_ms)]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=17, help="messages per request")
    parser.add_argument("--concurrency", type=int, default=32, help="requests per burst")
    parser.add_argument("--rounds", type=int, default=40, help="measured bursts per way")
    parser.add_argument("--step-ms", type=float, default=2.0, help="server pause before each message")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    load = Load(args.messages, args.concurrency, args.rounds, args.step_ms)
    if args.serve is not None:
        asyncio.run(serve(args.serve, load))
        return
    print(f"CPU ms per request, {load.concurrency} concurrent, {load.messages} messages each:")
    for name, figures in run(load).items():
        print(f"  {name:5s}  server {figures['server ms']:.3f}  client {figures['client ms']:.3f}")


if __name__ == "__main__":
    main()
