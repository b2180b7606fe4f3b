"""The gateway's /readyz against real gRPC health servers: 503 while the encoder is not SERVING;
every model's LLM services are asked and a model none of whose services is SERVING is named,
without failing readiness (deploy/README.md: one model down must not take the gateway, and every
other model, out of the Service). The whole stack's /readyz is checked in test_end_to_end and,
with an LLM service killed, in test_gateway_reconnect."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import httpx
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.harness import BackgroundLoop, free_port, start_gateway

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _health_server(status: int) -> tuple[grpc.aio.Server, str]:
    """A gRPC server with only the standard health service, reporting `status` for service ""."""
    server = grpc.aio.server()
    servicer = health.aio.HealthServicer()
    await servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@contextmanager
def _gateway(loop: BackgroundLoop, encoder: str, models: dict[str, list[str]]) -> Iterator[str]:
    app = create_app(GatewaySettings(encoder_target=encoder, models=models))
    server, port = loop.run(start_gateway(app))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True


def test_readyz_names_the_backends_that_are_not_serving(background_loop: BackgroundLoop) -> None:
    servers = {
        name: background_loop.run(_health_server(status))
        for name, status in {"encoder": SERVING, "up": SERVING, "starting": NOT_SERVING}.items()
    }
    target = {name: address for name, (_, address) in servers.items()}
    nobody = f"127.0.0.1:{free_port()}"  # nothing listens there
    models = {
        "all-up": [target["up"]],
        "half-up": [nobody, target["up"]],  # one serving service is enough
        "loading": [target["starting"]],
        "gone": [nobody],
    }
    try:
        with _gateway(background_loop, target["encoder"], models) as base_url:
            ready = httpx.get(f"{base_url}/readyz", timeout=10)
            assert ready.status_code == 200, ready.text
            assert ready.json() == {
                "status": "degraded",
                "encoder_ready": True,
                "models_not_ready": ["gone", "loading"],
            }

        with _gateway(background_loop, target["encoder"], {"all-up": [target["up"]]}) as base_url:
            ready = httpx.get(f"{base_url}/readyz", timeout=10)
            assert (ready.status_code, ready.json()) == (
                200,
                {"status": "ok", "encoder_ready": True, "models_not_ready": []},
            )

        for encoder in (target["starting"], nobody):
            with _gateway(background_loop, encoder, {"all-up": [target["up"]]}) as base_url:
                ready = httpx.get(f"{base_url}/readyz", timeout=10)
                assert ready.status_code == 503, ready.text
                assert ready.json() == {"status": "not ready", "encoder_ready": False, "models_not_ready": []}
    finally:
        for server, _ in servers.values():
            background_loop.run(server.stop(None))
