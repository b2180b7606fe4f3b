"""Graceful gRPC serving: health, reflection, the error interceptor, readiness, and SIGTERM drain.

Drain: readiness goes NOT_SERVING, the server refuses new calls, and the process ends as soon as
the calls in flight have finished (or the grace runs out). grpc's own `server.stop(grace)` waits
until every call has ended, open-ended ones included: one health Watch (a client-side health
checker, a load balancer) kept every drain waiting for the whole grace. So the calls are counted
here, Watch streams left out, and the server is stopped for good once the count reaches zero.
A GenerateMany stream is not counted either (it stays open between calls); each call it carries
is (shared/grpc_subcalls.py), and new ones are refused from the start of the drain.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import readiness
from shared.grpc_auth import TokenAuthInterceptor
from shared.grpc_errors import ErrorMappingInterceptor
from shared.grpc_metrics import MetricsInterceptor
from shared.grpc_subcalls import SubcallChain
from shared.grpc_wrap import within
from shared.request_context import RequestContextInterceptor
from shared.tracing import TracingInterceptor

logger = logging.getLogger(__name__)


# Clients re-resolve DNS only when a connection ends; ageing connections out lets
# gateways behind a headless Service discover pods added by a scale-up.
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000
# After the grace, calls still open on an aged connection are cut (UNAVAILABLE "max connection age"):
# it must cover the longest Generate stream, which the gateway waits for up to its 300 s deadline.
MAX_CONNECTION_AGE_GRACE_MS = 5 * 60 * 1000


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
        ("grpc.max_connection_age_grace_ms", MAX_CONNECTION_AGE_GRACE_MS),
        # Clients ping every 15 s, with or without calls (shared.sdk.types.channel_options). A server
        # that thinks pings come too often answers GOAWAY (too_many_pings) and drops the connection,
        # with every call on it: by default it wants 5 minutes between pings while no data flows, so a
        # call silent for ~45 s (a long encode, a request queued behind a long prefill) was cut.
        # The name is C-core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; gRPC ignores
        # names it does not know, silently (tests/test_grpc_keepalive.py holds both).
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]


@dataclass(frozen=True)
class ServerSecurity:
    """Optional shared token and TLS key pair (PEM bytes) of a gRPC server."""

    token: str | None = None
    tls_key_pair: tuple[bytes, bytes] | None = None  # (private key, certificate chain)

    @classmethod
    def from_files(cls, token: str | None, cert_file: str | None, key_file: str | None) -> ServerSecurity:
        if (cert_file is None) != (key_file is None):
            raise ValueError("set both grpc_tls_cert_file and grpc_tls_key_file, or neither")
        pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes()) if cert_file and key_file else None
        return cls(token or None, pair)

    def auth(self) -> list[grpc.aio.ServerInterceptor]:
        """Refuses strangers: calls without the token, when one is set."""
        return [TokenAuthInterceptor(self.token)] if self.token else []

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls_key_pair is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, grpc.ssl_server_credentials([self.tls_key_pair]))


def per_call_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """What every call goes through, outermost first: name the request, trace it, time it, map its errors."""
    return [RequestContextInterceptor(), TracingInterceptor(), MetricsInterceptor(), ErrorMappingInterceptor()]


# The health service name that liveness (and startup) probes ask for. It is SERVING from the moment
# the server starts until it stops, whatever Redis or other dependencies do: readiness ("" and the
# service names) follows them, and a liveness probe on readiness would restart every pod of the
# fleet during a Redis outage, which a restart cannot fix.
LIVENESS_SERVICE = "liveness"
# Calls that stay open for as long as their client likes: a drain neither counts nor waits for them.
OPEN_ENDED_METHODS = frozenset({"/grpc.health.v1.Health/Watch"})
# Once the last counted call has returned, how long its final status gets to reach the client
# before the calls left (open-ended ones) are cancelled.
FLUSH_S = 1.0


class InFlight(grpc.aio.ServerInterceptor):
    """Counts the unary and server-streaming calls being served, open-ended ones excepted."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    @contextmanager
    def _counted(self) -> Iterator[None]:
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler_call_details.method in OPEN_ENDED_METHODS:
            return handler

        return within(handler, lambda _context: self._counted())


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    in_flight: InFlight = field(default_factory=InFlight)
    subcalls: SubcallChain = field(default_factory=lambda: SubcallChain([]))
    _readiness: asyncio.Task[None] | None = field(default=None, init=False, repr=False)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def follow_readiness(self, checks: Mapping[str, readiness.Check]) -> None:
        """Reports SERVING only while every check passes (shared/readiness.py), from now until
        `stop`: the checks run once before this returns, then about every second."""
        down = await readiness.failing(checks)
        await self.set_serving(not down)
        if down:
            readiness.log_change(down)
        self._readiness = asyncio.create_task(readiness.follow(checks, self.set_serving, not down))

    async def stop(self, grace_s: float) -> None:
        """Readiness goes NOT_SERVING for good, new calls are refused, and the server stops as
        soon as the calls in flight have finished, or when `grace_s` runs out."""
        await self.health.enter_graceful_shutdown()  # NOT_SERVING, and nothing sets it back
        self.subcalls.close()  # calls multiplexed on streams already open are refused from now on too
        if self._readiness is not None:
            self._readiness.cancel()
        stopping = asyncio.ensure_future(self.server.stop(grace_s))
        idle = asyncio.ensure_future(self.in_flight.wait_idle())
        await asyncio.wait({stopping, idle}, return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()
        if not stopping.done():  # every counted call ended; only open-ended ones may be left
            await self.server.stop(FLUSH_S)
        await stopping


# Adds a service's servicers to the server; the chain is for servicers that serve calls multiplexed
# over one stream (shared/grpc_subcalls.py).
Register = Callable[[grpc.aio.Server, SubcallChain], None]


async def start_server(
    register: Register,
    service_names: Iterable[str],
    address: str,
    max_message_bytes: int,
    security: ServerSecurity = ServerSecurity(),
) -> RunningServer:
    """Starts a server with the given servicers; health stays NOT_SERVING until `set_serving(True)`
    or `follow_readiness`."""
    in_flight, per_call = InFlight(), per_call_interceptors()
    interceptors = [in_flight, *security.auth(), *per_call]
    # The server's own interceptor objects, so inner calls count toward the drain as calls do; the
    # token check is left out: the stream carrying them passed it.
    subcalls = SubcallChain([in_flight, *per_call])
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options(max_message_bytes))
    register(server, subcalls)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = security.bind(server, address)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    await server.start()
    running = RunningServer(server, health_servicer, port, names, in_flight, subcalls)
    await running.set_serving(False)
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    return running


async def serve_until_signal(
    running: RunningServer, grace_s: float, fatal: Awaitable[str] | None = None, fatal_grace_s: float = 2.0
) -> str | None:
    """Blocks until SIGTERM/SIGINT, then drains for up to `grace_s` and stops. When `fatal`
    completes first (the service can no longer serve), drains for up to `fatal_grace_s` instead
    and returns its reason, for the caller to exit non-zero and be restarted; else returns None."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info("serving on port %d", running.port)
    signalled: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    failed: asyncio.Future[str] | None = asyncio.ensure_future(fatal) if fatal is not None else None
    waiting: set[asyncio.Future[Any]] = {signalled} if failed is None else {signalled, failed}
    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    reason = failed.result() if failed is not None and failed.done() else None
    for task in waiting:
        if not task.done():
            task.cancel()
    if reason is not None:
        logger.error("cannot serve any more (%s): draining for up to %.1fs, then exiting", reason, fatal_grace_s)
        await running.stop(fatal_grace_s)
    else:
        logger.info("stopping: draining for up to %.1fs", grace_s)
        await running.stop(grace_s)
    return reason
