"""A restarted LLM service is served again within seconds of reporting SERVING, against the real
processes (tests/process_stack.py). gRPC's default reconnect backoff grows to 120 s: after a long
outage, the gateway answered 503 for 32-85 s while /health, asking on fresh channels, said SERVING.
Slow (a process stack, a ~25 s outage and a restart), so in a file of its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.process_stack import ProcessStack, process_stack

OUTAGE_S = 25  # long enough for the default backoff to have grown past 15 s
SERVED_AGAIN_WITHIN_S = 5  # the channels' reconnect backoff is capped at 2 s


@pytest.fixture(scope="module")
def processes(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessStack]:
    with process_stack(checkpoints, tmp_path_factory.mktemp("reconnect")) as running:
        yield running


def chat_status(stack: ProcessStack, model: str) -> int:
    body = {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30).status_code


def test_a_restarted_service_is_served_within_seconds_of_serving_and_readiness_ignores_it(
    processes: ProcessStack,
) -> None:
    stack = processes
    assert chat_status(stack, "ft-b") == 200
    service = stack.service("ft-b")
    service.kill()  # and not relaunched by the launcher's supervisor: the outage is ours to time
    down_until = time.monotonic() + OUTAGE_S
    while time.monotonic() < down_until:  # traffic all along, so the gateway keeps reconnecting
        assert chat_status(stack, "ft-b") == 503
        time.sleep(0.5)
    # Readiness is the encoder's (deploy/README.md): one model down takes no other model down.
    assert httpx.get(f"{stack.base_url}/readyz", timeout=5).status_code == 200
    assert httpx.get(f"{stack.base_url}/health", timeout=5).status_code == 503
    assert chat_status(stack, "ft-a") == 200

    service.launch()
    deadline = time.monotonic() + 180
    while stack.grpc_health("ft-b") != "SERVING":
        assert time.monotonic() < deadline, stack.log_tail("ft-b")
        time.sleep(0.1)
    serving_at = time.monotonic()
    while chat_status(stack, "ft-b") != 200:
        assert time.monotonic() - serving_at < SERVED_AGAIN_WITHIN_S, "still 503 although the service is SERVING"
        time.sleep(0.2)
