"""Gateway edges an outside tester found, each against real servers: uvicorn on a real socket in
front of the real encoder and LLM gRPC services of the session stack.

A crash still carries x-request-id; a .npy header cannot make the gateway allocate what was never
sent; request types are strict and every 4xx is OpenAI-shaped; the body limit holds for a chunked
body; round robin takes one turn per request and passes over a dead service; a streaming client
that leaves before the response head gives its admission slot back."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from gateway.app import create_app
from llm_service.core import LLMCore
from llm_service.server import LLMServer, start_llm_server
from llm_service.settings import LLMSettings
from tests.harness import BackgroundLoop, Stack, gateway_settings_for, start_gateway
from tests.http_server import QuietHandler, serving
from tests.images import png_bytes

KEY = {"Authorization": "Bearer test-key-1"}


def chat_body(model: str = "ft-b", content: Any = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": content}],
            **extra}  # fmt: skip


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert param is None or error["param"] == param, error
    return error


@contextmanager
def own_gateway(loop: BackgroundLoop, app: FastAPI) -> Iterator[FastAPI]:
    """Serves `app` on a free port; its base URL is app.state.base_url."""
    server, port = loop.run(start_gateway(app))
    app.state.base_url = f"http://127.0.0.1:{port}"
    try:
        yield app
    finally:
        server.should_exit = True


# 1. ------------------------------------------------------------------------------------------


def test_an_unhandled_error_is_an_openai_500_with_the_request_id(stack: Stack, background_loop: BackgroundLoop) -> None:
    app = create_app(gateway_settings_for(stack.encoder, stack.llms))

    async def crash() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/crash", crash)
    with own_gateway(background_loop, app):
        response = httpx.get(f"{app.state.base_url}/crash", headers={"x-request-id": "crash-1"}, timeout=10)
        error = assert_openai_error(response, 500)
        assert response.headers.get("x-request-id") == "crash-1"
        assert error["type"] == "server_error" and "a bug" not in error["message"]
        anonymous = httpx.get(f"{app.state.base_url}/crash", timeout=10)
        assert len(anonymous.headers.get("x-request-id", "")) == 32


# 2. ------------------------------------------------------------------------------------------


def _npy(header: str, data: bytes) -> bytes:
    text = header.encode()
    text += b" " * (-(10 + len(text) + 1) % 64) + b"\n"  # numpy pads the header to 64 bytes
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data


def _inline_part(payload: bytes) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": base64.b64encode(payload).decode(), "image_grid_thw": [1, 4, 4]}


@pytest.mark.parametrize(
    "payload",
    [
        # ~1 TB claimed, 16 bytes sent: np.load allocated the claim first (MemoryError, a 500)
        _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 256), }", b"\0" * 16),
        _npy("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2, 2), }", b"\0" * 16),
        _npy("{'descr': '|O', 'fortran_order': False, 'shape': (2, 2), }", b"\0" * 32),
        b"\x93NUMPY\x02\x00" + struct.pack("<I", 2**32 - 1) + b"{",  # a header length of 4 GiB
    ],
    ids=["more-rows-than-sent", "3-d", "object-dtype", "huge-header-length"],
)
def test_a_hostile_npy_header_is_400_naming_the_part(strict_gateway: str, payload: bytes) -> None:
    body = chat_body(content=[_inline_part(payload), {"type": "text", "text": "hi"}])
    response = httpx.post(f"{strict_gateway}/v1/chat/completions", json=body, headers=KEY, timeout=60)
    assert_openai_error(response, 400, param="messages[0].content[0].image_embeds")


def test_a_safetensors_header_declaring_more_than_sent_is_400(strict_gateway: str) -> None:
    header = json.dumps({"image_embeds": {"dtype": "F32", "shape": [10**9, 256], "data_offsets": [0, 16]}}).encode()
    payload = struct.pack("<Q", len(header)) + header + b"\0" * 16
    body = chat_body(content=[_inline_part(payload), {"type": "text", "text": "hi"}])
    response = httpx.post(f"{strict_gateway}/v1/chat/completions", json=body, headers=KEY, timeout=60)
    assert_openai_error(response, 400, param="messages[0].content[0].image_embeds")


def test_a_fortran_order_npy_answers_like_the_c_order_one(strict_gateway: str, stack: Stack) -> None:
    rows = np.random.default_rng(3).standard_normal((4, 256), dtype=np.float32)
    answers = []
    for array in (rows, np.asfortranarray(rows)):
        buffer = io.BytesIO()
        np.save(buffer, array)
        body = chat_body(content=[_inline_part(buffer.getvalue()), {"type": "text", "text": "hi"}], max_tokens=4)
        response = httpx.post(f"{strict_gateway}/v1/chat/completions", json=body, headers=KEY, timeout=60)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]


# 3. ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"max_tokens": "12"}, "max_tokens"), ({"stream": "yes"}, "stream"), ({"max_tokens": 12.5}, "max_tokens"),
     ({"temperature": "0"}, "temperature"), ({"n": True}, "n"), ({"stream_options": {"include_usage": 1}},
     "stream_options.include_usage")],
)  # fmt: skip
def test_values_of_the_wrong_json_type_are_400(stack: Stack, extra: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat_body(**extra), timeout=60)
    assert_openai_error(response, 400, param=param)


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_a_stream_are_400_as_openai_answers(stack: Stack, stream: bool | None) -> None:
    extra: dict[str, Any] = {"stream_options": {"include_usage": True}}
    if stream is not None:
        extra["stream"] = stream
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat_body(**extra), timeout=60)
    error = assert_openai_error(response, 400, param="stream_options")
    assert "stream" in error["message"], error


def test_an_integer_temperature_is_a_float(stack: Stack) -> None:
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat_body(temperature=1, seed=1), timeout=60)
    assert response.status_code == 200, response.text


def test_http_errors_of_the_framework_are_openai_shaped(stack: Stack) -> None:
    not_utf8 = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        content=b'{"model": "ft-b", "x": "\xff\xfe"}',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert "UTF-8" in assert_openai_error(not_utf8, 400)["message"]
    assert_openai_error(httpx.get(f"{stack.base_url}/v1/no-such-route", timeout=10), 404)
    assert_openai_error(httpx.get(f"{stack.base_url}/v1/chat/completions", timeout=10), 405)


# 4. ------------------------------------------------------------------------------------------


def test_a_chunked_body_over_the_limit_is_413_and_a_normal_one_still_works(
    stack: Stack, background_loop: BackgroundLoop
) -> None:
    limit = 64 * 1024
    sent = 0

    def chunked() -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        nonlocal sent
        head = json.dumps(chat_body())[:-1].encode() + b', "padding": "'
        for chunk in (head, *([b"x" * 16384] * 64), b'"}'):  # 1 MiB, valid JSON
            sent += len(chunk)
            yield chunk

    settings = gateway_settings_for(stack.encoder, stack.llms, max_body_bytes=limit)
    with own_gateway(background_loop, create_app(settings)) as app:
        url = f"{app.state.base_url}/v1/chat/completions"
        response = httpx.post(url, content=chunked(), headers={"content-type": "application/json"}, timeout=60)
        assert "content-length" not in response.request.headers
        assert sent > limit
        assert_openai_error(response, 413)
        assert response.headers.get("x-request-id")
        assert httpx.post(url, json=chat_body(), timeout=60).status_code == 200


# 5. ------------------------------------------------------------------------------------------


class CountingCore:
    """The session's ft-b core, counting the generations asked of one server."""

    def __init__(self, core: LLMCore) -> None:
        self._core = core
        self.generations = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def generate(self, chat: Any) -> AsyncIterator[Any]:
        self.generations += 1
        return self._core.generate(chat)


def _second_server(stack: Stack, checkpoints: dict[str, Path], loop: BackgroundLoop) -> tuple[LLMServer, CountingCore]:
    core = CountingCore(stack.llms["ft-b"].core)
    settings = LLMSettings(checkpoint=str(checkpoints["ft-b"]), model_name="ft-b", engine="transformers",
                           redis_url=stack.redis.url, host="127.0.0.1", port=0)  # fmt: skip
    return loop.run(start_llm_server(settings, core)), core  # type: ignore[arg-type]


def test_round_robin_takes_turns_and_passes_over_a_dead_service(
    stack: Stack, checkpoints: dict[str, Path], background_loop: BackgroundLoop
) -> None:
    (first, first_core), (second, second_core) = (_second_server(stack, checkpoints, background_loop) for _ in "ab")
    targets = [f"127.0.0.1:{first.port}", f"127.0.0.1:{second.port}"]
    settings = gateway_settings_for(stack.encoder, stack.llms).model_copy(update={"models": {"ft-b": targets}})
    try:
        with own_gateway(background_loop, create_app(settings)) as app:
            url = f"{app.state.base_url}/v1/chat/completions"
            for _ in range(4):
                assert httpx.post(url, json=chat_body(), timeout=60).status_code == 200
            assert (first_core.generations, second_core.generations) == (2, 2)
            background_loop.run(second.running.stop(0))  # the core is the session's: only the server stops
            statuses = [httpx.post(url, json=chat_body(), timeout=60).status_code for _ in range(4)]
            assert statuses == [200] * 4
            assert first_core.generations == 6
    finally:
        for server in (first, second):
            background_loop.run(server.running.stop(0))


# 7. ------------------------------------------------------------------------------------------


@contextmanager
def slow_image_server(delay_s: float) -> Iterator[str]:
    """Serves a PNG per path after `delay_s`, so a chat request that names one cannot answer sooner."""

    class Handler(QuietHandler):
        def do_GET(self) -> None:
            time.sleep(delay_s)
            image = png_bytes(sum(self.path.encode()))
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

    with serving(Handler) as base_url:
        yield base_url


def _leave_before_the_head(base_url: str, body: dict[str, Any], after_s: float) -> None:
    """Sends a streaming chat request over a raw socket and hangs up `after_s` later, unanswered."""
    payload = json.dumps(body).encode()
    port = int(base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        time.sleep(after_s)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing came back yet: no response head
            sock.recv(1)


def _in_flight_metric(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("gateway_chat_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no gateway_chat_in_flight")


def test_streaming_clients_that_leave_before_the_head_give_their_slots_back(
    stack: Stack, background_loop: BackgroundLoop
) -> None:
    settings = gateway_settings_for(stack.encoder, stack.llms, max_concurrent_requests=3)
    with slow_image_server(delay_s=1.5) as images, own_gateway(background_loop, create_app(settings)) as app:
        base_url = app.state.base_url
        for i in range(3):
            image = {"type": "image_url", "image_url": {"url": f"{images}/leave-{i}-{time.time()}.png"}}
            _leave_before_the_head(base_url, chat_body(content=[image, {"type": "text", "text": "hi"}], stream=True),
                                   after_s=0.5)  # fmt: skip
        deadline = time.monotonic() + 30
        while app.state.admission.in_flight and time.monotonic() < deadline:
            time.sleep(0.2)
        assert app.state.admission.in_flight == 0
        assert _in_flight_metric(base_url) == 0  # process-wide; the other gateways here are idle
        for _ in range(4):  # more than the limit, one after another
            response = httpx.post(f"{base_url}/v1/chat/completions", json=chat_body(stream=True), timeout=60)
            assert response.status_code == 200, response.text
