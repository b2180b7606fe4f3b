"""Session fixtures: tiny checkpoints, a real Redis, and the whole stack on free ports; test tiers.

Tiers (`make test` runs all three; `make test-fast` runs `-m unit`):
- unit: starts nothing (no process, no server); pure logic, in well under a minute all together.
- integration: real processes or servers (Redis, gRPC servers, an engine, tiny checkpoints).
- e2e: through the whole stack (gateway, encoder, LLM services, Redis).
A test's tier follows from the fixtures it uses (below); a file whose tests start processes by
themselves says so with `pytestmark = pytest.mark.integration`. A test that lands in the unit tier
and starts a process or a server anyway fails, so the fast tier stays fast.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi import FastAPI
from openai import OpenAI

from gateway.app import create_app
from shared.grpc_metrics import serve_metrics
from tests.encoder_process import EncoderProcess, running_encoder
from tests.harness import (
    BackgroundLoop,
    RedisServer,
    Stack,
    free_port,
    gateway_settings_for,
    start_gateway,
    start_stack,
    stop_stack,
)
from tests.model_fixtures import build_test_checkpoints

MODELS = ("ft-a", "ft-b")
TIERS = ("unit", "integration", "e2e")
E2E_FIXTURES = frozenset({"stack", "openai_client", "strict_gateway_app", "strict_gateway"})
INTEGRATION_FIXTURES = frozenset({"checkpoints", "redis_server", "live_redis", "background_loop"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        explicit = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(explicit) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked with more than one tier: {sorted(explicit)}")
        if explicit:
            continue
        fixtures = set(getattr(item, "fixturenames", ()))
        tier = "e2e" if fixtures & E2E_FIXTURES else "integration" if fixtures & INTEGRATION_FIXTURES else "unit"
        item.add_marker(tier)


@pytest.fixture(autouse=True)
def _unit_tests_start_nothing(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(
            f"{request.node.nodeid} is in the unit tier but starts a process or a server: "
            "use a fixture that marks it, or mark its file `pytestmark = pytest.mark.integration`"
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(grpc, "server", refuse)
    monkeypatch.setattr(grpc.aio, "server", refuse)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_test_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def lone_encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EncoderProcess]:
    """An encoder service of the module's own, as a process (tests/encoder_process.py)."""
    with running_encoder(
        checkpoints["base"], redis_server.url, tmp_path_factory.mktemp("enc") / "encoder.log"
    ) as process:
        yield process


@pytest.fixture(scope="session")
def background_loop() -> Iterator[BackgroundLoop]:
    loop = BackgroundLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def stack(checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop) -> Iterator[Stack]:
    running = background_loop.run(start_stack(checkpoints, redis_server, MODELS))
    yield running
    background_loop.run(stop_stack(running))


@pytest.fixture(scope="session")
def metrics_url() -> str:
    """/metrics of this process, served as each service's __main__ serves it (the test stack's
    services run in this process)."""
    port = free_port()
    serve_metrics(port)
    return f"http://127.0.0.1:{port}/metrics"


@pytest.fixture
def live_redis(redis_server: RedisServer) -> Iterator[RedisServer]:
    """The session Redis, guaranteed running again after the test (tests may stop it)."""
    yield redis_server
    if redis_server.process is None:
        redis_server.start()


@pytest.fixture(scope="session")
def openai_client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def strict_gateway_app(stack: Stack, background_loop: BackgroundLoop) -> Iterator[FastAPI]:
    """A second gateway on the same backends: API keys, inline embeddings on, one request at a time."""
    settings = gateway_settings_for(
        stack.encoder,
        stack.llms,
        api_keys=["test-key-1", "test-key-2"],
        allow_inline_embeds=True,
        max_concurrent_requests=1,
    )
    app = create_app(settings)
    server, port = background_loop.run(start_gateway(app))
    app.state.base_url = f"http://127.0.0.1:{port}"
    yield app
    server.should_exit = True


@pytest.fixture(scope="session")
def strict_gateway(strict_gateway_app: FastAPI) -> str:
    return strict_gateway_app.state.base_url
