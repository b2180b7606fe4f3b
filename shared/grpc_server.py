"""Graceful gRPC serving: health, reflection, the error interceptor, and SIGTERM drain."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared.grpc_auth import TokenAuthInterceptor
from shared.grpc_errors import ErrorMappingInterceptor
from shared.grpc_metrics import MetricsInterceptor
from shared.request_context import RequestContextInterceptor

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
        # that thinks pings come too often answers GOAWAY (too_many_pings) and drops the connection.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
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

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Outermost first: refuse strangers, then name the request, time it, map its errors."""
        auth = [TokenAuthInterceptor(self.token)] if self.token else []
        return [*auth, RequestContextInterceptor(), MetricsInterceptor(), ErrorMappingInterceptor()]

    def bind(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls_key_pair is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, grpc.ssl_server_credentials([self.tls_key_pair]))


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        """Readiness goes NOT_SERVING first, then in-flight RPCs get `grace_s` to finish."""
        await self.set_serving(False)
        await self.server.stop(grace_s)


async def start_server(
    register: Callable[[grpc.aio.Server], None],
    service_names: Iterable[str],
    address: str,
    max_message_bytes: int,
    security: ServerSecurity = ServerSecurity(),
) -> RunningServer:
    """Starts a server with the given servicers; health stays NOT_SERVING until `set_serving(True)`."""
    server = grpc.aio.server(interceptors=security.interceptors(), options=grpc_options(max_message_bytes))
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(service_names)
    reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = security.bind(server, address)
    if port == 0:
        raise RuntimeError(f"could not bind gRPC server to {address}")
    await server.start()
    running = RunningServer(server, health_servicer, port, names)
    await running.set_serving(False)
    return running


async def serve_until_signal(running: RunningServer, grace_s: float) -> None:
    """Blocks until SIGTERM/SIGINT, then drains and stops."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info("serving on port %d", running.port)
    await stop.wait()
    logger.info("stopping: draining for up to %.1fs", grace_s)
    await running.stop(grace_s)
