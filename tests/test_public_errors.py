"""A server-side error (5xx) tells an outside client what failed in its own terms (the model it
asked for, the encoding of its images and videos) and whether to retry, never the addresses or
parts of the deployment; the full detail goes to the gateway's summary line, under the request id
the response carries. Each against real servers: a gateway of its own in front of the session
stack's encoder and LLM services, with routes to a port nothing listens on and to a gRPC server
that is no LLM service."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.harness import BackgroundLoop, RedisServer, Stack, free_port
from tests.images import data_url, png_bytes
from tests.test_gateway_edges import own_gateway
from tests.test_logs import gateway_lines, summaries

DEAD = f"127.0.0.1:{free_port()}"  # nothing listens there


def _settings(stack: Stack, **overrides: Any) -> GatewaySettings:
    fields: dict[str, Any] = {
        "encoder_target": stack.encoder_target,
        "models": {
            "ft-a": [stack.llm_target("ft-a")],
            "gone": [DEAD],
            "not-an-llm": [stack.encoder_target],  # a gRPC server without the LLM service: a 500
        },
        "request_timeout_s": 60,
        **overrides,
    }
    return GatewaySettings(**fields)


@pytest.fixture(scope="module")
def gateway(stack: Stack, background_loop: BackgroundLoop) -> Iterator[FastAPI]:
    with own_gateway(background_loop, create_app(_settings(stack))) as app:
        yield app


def _chat(model: str, image: bool = False) -> dict[str, Any]:
    text = {"type": "text", "text": "What is it?"}
    content = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(8191))}}, text] if image else "hi"
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def _told(app: FastAPI, path: str, body: dict[str, Any], request_id: str, status: int) -> tuple[str, str]:
    """(what the client was told, what the summary line says) of one failed request."""
    with gateway_lines(request_id) as lines:
        response = httpx.post(
            f"{app.state.base_url}{path}", json=body, headers={"x-request-id": request_id}, timeout=60
        )
    assert response.status_code == status, response.text
    assert response.headers["x-request-id"] == request_id
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] is None, error
    (summary,) = summaries(lines, request_id)
    assert summary["status"] == status
    return error["message"], summary["error"]


def test_an_llm_service_down_is_the_models_503_without_its_address(gateway: FastAPI) -> None:
    told, logged = _told(gateway, "/v1/chat/completions", _chat("gone"), "public-llm-down", 503)
    assert told == "the model 'gone' is unavailable right now; retry later"
    assert DEAD in logged  # the operator still learns which service


def test_an_encoder_down_is_the_encodings_503_without_its_address(
    stack: Stack, background_loop: BackgroundLoop
) -> None:
    with own_gateway(background_loop, create_app(_settings(stack, encoder_target=DEAD))) as app:
        for path, body, request_id in [
            ("/v1/chat/completions", _chat("ft-a", image=True), "public-encoder-down-chat"),
            ("/v1/images/encode", {"image_url": data_url(png_bytes(8192))}, "public-encoder-down-encode"),
        ]:
            told, logged = _told(app, path, body, request_id, 503)
            assert told == "image and video encoding is unavailable right now; retry later"
            assert DEAD in logged


def test_redis_down_is_a_503_that_does_not_name_redis(gateway: FastAPI, live_redis: RedisServer) -> None:
    live_redis.stop()
    told, logged = _told(gateway, "/v1/chat/completions", _chat("ft-a", image=True), "public-redis-down", 503)
    assert told == "image and video encoding is unavailable right now; retry later"
    assert "embedding store (Redis) is unavailable" in logged


def test_a_deadline_passed_is_the_models_504(stack: Stack, background_loop: BackgroundLoop) -> None:
    with own_gateway(background_loop, create_app(_settings(stack, request_timeout_s=0.001))) as app:
        told, logged = _told(app, "/v1/chat/completions", _chat("ft-a"), "public-deadline", 504)
    assert told == "the model 'ft-a' did not finish in time; retry later"
    assert logged.startswith("timeout: ")


def test_an_internal_error_is_a_500_that_names_the_request_id_not_the_backend(gateway: FastAPI) -> None:
    told, logged = _told(gateway, "/v1/chat/completions", _chat("not-an-llm"), "public-internal", 500)
    assert (
        told
        == "the model 'not-an-llm' failed with an internal error; quote request id public-internal when you report it"
    )
    assert "UNIMPLEMENTED" in logged  # what really happened, for the operator


def test_health_names_each_backend_by_what_it_is_not_where_it_is(gateway: FastAPI, stack: Stack) -> None:
    response = httpx.get(f"{gateway.state.base_url}/health", timeout=30)
    assert response.status_code == 503  # nothing listens for "gone"
    # "not-an-llm" routes to the encoder's port, whose server reports SERVING.
    assert response.json()["backends"] == {"encoder": True, "ft-a/0": True, "gone/0": False, "not-an-llm/0": True}
    for address in (DEAD, stack.encoder_target, stack.llm_target("ft-a")):
        assert address not in response.text
