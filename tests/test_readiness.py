"""The gateway's /readyz against real gRPC health servers: 503 while the encoder is not SERVING;
every model's LLM services are asked and a model none of whose services is SERVING is named,
without failing readiness (deploy/README.md: one model down must not take the gateway, and every
other model, out of the Service). The whole stack's /readyz is checked in test_end_to_end and,
with an LLM service killed, in test_gateway_reconnect."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.harness import BackgroundLoop, free_port, start_gateway

REPO = Path(__file__).resolve().parent.parent
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


@contextmanager
def _silent_listener() -> Iterator[str]:
    """A port that accepts connections (the kernel completes them) and never says a word: a hung
    backend, whose health check can only time out."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def _readiness_probe_timeout_s() -> float:
    yaml = pytest.importorskip("yaml", reason="PyYAML reads the gateway's manifest")
    documents = yaml.safe_load_all((REPO / "deploy/base/gateway.yaml").read_text())
    (deployment,) = [d for d in documents if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return float(container["readinessProbe"]["timeoutSeconds"])


def test_readyz_answers_within_the_probe_timeout_however_many_backends_hang(background_loop: BackgroundLoop) -> None:
    """Each hung backend costs a 1 s health check; asked one after another, four would outlast the
    kubelet's probe and take the whole gateway out of the Service for models that are down."""
    encoder, encoder_address = background_loop.run(_health_server(SERVING))
    try:
        with ExitStack() as stack:
            hung = {f"hung-{i}": [stack.enter_context(_silent_listener())] for i in range(4)}
            with _gateway(background_loop, encoder_address, hung) as base_url:
                started = time.monotonic()
                ready = httpx.get(f"{base_url}/readyz", timeout=30)
                took = time.monotonic() - started
        assert (ready.status_code, ready.json()["models_not_ready"]) == (200, sorted(hung))
        assert took < _readiness_probe_timeout_s(), f"/readyz took {took:.1f} s"
    finally:
        background_loop.run(encoder.stop(None))
