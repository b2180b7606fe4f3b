"""Keepalive: clients ping every 15 s with or without data (shared.sdk.types.channel_options), and
servers must accept that (shared.grpc_server.grpc_options), or they answer GOAWAY too_many_pings
and cut every call on the connection. gRPC ignores option names it does not know, silently: a
misspelled server option left its 5-minute default, and a call silent for ~45 s was cut."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import grpc
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


def test_a_silent_call_outlives_the_clients_pings(stack: Stack) -> None:
    options = [(name, value) for name, value in channel_options(1024) if name != "grpc.keepalive_time_ms"]
    with grpc.insecure_channel(
        stack.encoder_target, options=[*options, ("grpc.keepalive_time_ms", PING_MS)]
    ) as channel:
        # Watch sends the status, then nothing until it changes: a call with no data flowing.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        outcome: queue.Queue[object] = queue.Queue()
        threading.Thread(target=lambda: outcome.put(_next_or_error(watch)), daemon=True).start()
        try:
            ended = outcome.get(timeout=SILENT_S)
        except queue.Empty:
            ended = None
        finally:
            watch.cancel()
    assert ended is None, f"the silent call ended after fewer than {SILENT_S:.0f} s: {ended}"
