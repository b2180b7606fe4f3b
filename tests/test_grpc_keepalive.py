"""Keepalive: clients ping every 15 s with or without data (shared.sdk.types.channel_options), and
servers must accept that (shared.grpc_server.grpc_options), or they answer GOAWAY too_many_pings
and cut every call on the connection. gRPC ignores option names it does not know, silently: a
misspelled server option left its 5-minute default, and a call silent for ~45 s was cut."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.grpc_server import grpc_options
from shared.sdk.types import channel_options
from tests.harness import Stack

PING_MS = 6_000  # a ping each 6 s: above the servers' 5 s floor, so the test runs in half a minute
SILENT_S = 5 * PING_MS / 1000  # before the fix the connection went away at about the fourth ping


def test_every_option_given_to_grpc_is_a_name_grpc_knows() -> None:
    binary = Path(cygrpc.__file__).read_bytes()  # C-core's argument names, as C strings
    names = {name for name, _ in grpc_options(1024) + channel_options(1024)}
    assert [name for name in sorted(names) if name.encode() + b"\0" not in binary] == []


def _next_or_error(stream: grpc.Call) -> object:
    try:
        return next(stream)
    except grpc.RpcError as error:
        return error


def _watch_ends(target: str, wait_s: float, then: Callable[[], None] = lambda: None) -> object:
    """How a health Watch on `target`, the client pinging each PING_MS, ends within `wait_s` after
    `then` runs (once the call is SERVING): its next message, its error, or None (still open).
    Watch sends the status, then nothing until it changes: a call with no data flowing."""
    options = [(name, value) for name, value in channel_options(1024) if name != "grpc.keepalive_time_ms"]
    with grpc.insecure_channel(target, options=[*options, ("grpc.keepalive_time_ms", PING_MS)]) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        then()
        outcome: queue.Queue[object] = queue.Queue()
        threading.Thread(target=lambda: outcome.put(_next_or_error(watch)), daemon=True).start()
        try:
            return outcome.get(timeout=wait_s)
        except queue.Empty:
            return None
        finally:
            watch.cancel()


def test_a_silent_call_outlives_the_clients_pings(stack: Stack) -> None:
    ended = _watch_ends(stack.encoder_target, SILENT_S)
    assert ended is None, f"the silent call ended after fewer than {SILENT_S:.0f} s: {ended}"


# A gRPC server in a process of its own, with the services' options, that a test can freeze.
_SERVER = """
import asyncio, sys
import grpc
from grpc_health.v1 import health, health_pb2_grpc
from shared.grpc_server import grpc_options

async def main() -> None:
    server = grpc.aio.server(options=grpc_options(1024))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""
FROZEN_FOUND_S = 25  # a ping within PING_MS, its ack missed after 5 s; gRPC's default waited 60 s


@pytest.mark.integration  # a gRPC server process of its own
def test_a_call_to_a_frozen_server_fails_within_a_ping_and_its_timeout() -> None:
    """A server that stops answering with its connection open (SIGSTOP, a hung node): the client's
    keepalive ping goes unanswered, and the calls on the connection fail UNAVAILABLE. gRPC waited
    for the ack by grpc.http2.ping_timeout_ms (60 s), not keepalive_timeout_ms: ~70 s at 15 s pings."""
    server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        frozen_at = time.monotonic()
        ended = _watch_ends(f"127.0.0.1:{port}", FROZEN_FOUND_S, then=lambda: server.send_signal(signal.SIGSTOP))
        assert isinstance(ended, grpc.RpcError), f"a call to a frozen server still open after {FROZEN_FOUND_S} s"
        assert ended.code() == grpc.StatusCode.UNAVAILABLE, ended
        print(f"frozen server found after {time.monotonic() - frozen_at:.1f} s")
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
