"""HTTP limits an outside tester found missing, against a real `python -m gateway` process with a
short read timeout and keep-alive (gateway/http_protocol.py, and redirect_slashes in gateway/app.py).

A head over GATEWAY_MAX_HEADER_BYTES is 431 and closed, not read whole; a request that stops
halfway (in its head or its body) is 408 and closed after GATEWAY_REQUEST_READ_TIMEOUT_S, while
one that trickles in, or that the app takes longer than that to answer, is served; a connection
that never sends a byte is closed after the keep-alive; a trailing slash is a 404, never a
redirect built from the client's Host header."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from scripts.redis_process import free_port
from tests.metrics_text import metric_sum, scrape

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent
READ_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 2.0
BACKEND_DEADLINE_S = 4.0
MAX_HEADER_BYTES = 64 * 1024  # the default
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def blackhole() -> Iterator[int]:
    """A port that accepts TCP connections and never answers: a backend call to it runs to its deadline."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(blackhole: int, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """`python -m gateway` on a free port; its one model "slow" is served by the black hole."""
    port = free_port()
    env = {
        **os.environ,
        "GATEWAY_HOST": "127.0.0.1",
        "GATEWAY_PORT": str(port),
        "GATEWAY_MODELS": json.dumps({"slow": [f"127.0.0.1:{blackhole}"]}),
        "GATEWAY_ENCODER_TARGET": f"127.0.0.1:{blackhole}",
        "GATEWAY_REQUEST_TIMEOUT_S": str(BACKEND_DEADLINE_S),
        "GATEWAY_REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        "GATEWAY_KEEP_ALIVE_S": str(KEEP_ALIVE_S),
        "GATEWAY_GENERATE_STREAMS": "0",
        "GATEWAY_JSON_LOGS": "false",
    }
    log = (tmp_path_factory.mktemp("gateway") / "gateway.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, f"the gateway exited; see {log.name}"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/livez", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def _connect(port: int, timeout_s: float = 10) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(timeout_s)
    return sock


def _send(sock: socket.socket, data: bytes) -> None:
    """Sends `data` in pieces, stopping where the server has closed the connection."""
    for start in range(0, len(data), 16 * 1024):
        try:
            sock.sendall(data[start : start + 16 * 1024])
        except (BrokenPipeError, ConnectionResetError):
            return


def _read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; socket.timeout if it does not close."""
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our unread bytes in its buffer: what it sent came first
            return received
        if not chunk:
            return received
        received += chunk


def _status_and_error(response: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"]


def _chat(model: str) -> bytes:
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps(body).encode()


def _unread_count(port: int, status: str) -> float:
    """Requests the protocol answered before the app saw them, as /metrics counts them."""
    text = scrape(f"http://127.0.0.1:{port}/metrics")
    return metric_sum(text, "gateway_http_requests_total", route="unread", status=status)


def test_a_head_over_the_limit_is_431_and_closed_and_one_under_it_is_served(gateway: int) -> None:
    before = _unread_count(gateway, "431")
    with _connect(gateway) as sock:
        _send(sock, b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        status, error = _status_and_error(_read_until_closed(sock))
    assert status == 431 and error["code"] == "headers_too_large", error
    with _connect(gateway) as sock:  # a head that ends within one read, measured by its parsed parts
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        assert _status_and_error(_read_until_closed(sock))[0] == 431
    assert _unread_count(gateway, "431") - before == 2  # both were answered and counted nowhere

    started = time.monotonic()
    assert httpx.get(f"http://127.0.0.1:{gateway}/livez", timeout=5).status_code == 200
    assert time.monotonic() - started < 1

    # Near the limit, sent in one write; and a small head sent in one write with a large body.
    near = {f"x-pad-{i}": "b" * 7000 for i in range(8)}
    assert httpx.get(f"http://127.0.0.1:{gateway}/v1/models", headers=near, timeout=10).status_code == 200
    padded = _chat("none") + b" " * (512 * 1024)
    response = httpx.post(f"http://127.0.0.1:{gateway}/v1/chat/completions", content=padded, timeout=10,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found", response.text


def test_a_head_that_stops_halfway_is_408_and_closed(gateway: int) -> None:
    before = _unread_count(gateway, "408")
    with _connect(gateway) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nX-Unfinished: a")
        started = time.monotonic()
        status, error = _status_and_error(_read_until_closed(sock))
    assert status == 408 and error["code"] == "request_timeout", error
    assert READ_TIMEOUT_S - 0.1 < time.monotonic() - started < READ_TIMEOUT_S + 3
    assert _unread_count(gateway, "408") - before == 1


def test_a_body_that_stops_halfway_is_408_and_slow_requests_are_served(gateway: int) -> None:
    """The read timeout times the client while it owes bytes: never a body that trickles in, nor
    the app (here a backend call that runs to its deadline)."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    with _connect(gateway) as sock:
        sock.sendall(head + b"Content-Length: 1000\r\n\r\n" + b'{"model":')
        started = time.monotonic()
        status, error = _status_and_error(_read_until_closed(sock))
    assert status == 408 and error["code"] == "request_timeout", error
    assert time.monotonic() - started < READ_TIMEOUT_S + 3

    body = _chat("none")
    pieces = [body[i : i + len(body) // 6 + 1] for i in range(0, len(body), len(body) // 6 + 1)]
    with _connect(gateway) as sock:
        sock.sendall(head + f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        for piece in pieces:  # each pause well under the read timeout, all of them well over it
            time.sleep(READ_TIMEOUT_S / 3)
            sock.sendall(piece)
        status, error = _status_and_error(_read_until_closed(sock))
    assert status == 404 and error["code"] == "model_not_found", error  # the body came whole and was parsed

    response = httpx.post(f"http://127.0.0.1:{gateway}/v1/chat/completions", content=_chat("slow"),
                          headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert response.status_code >= 500 and "error" in response.json(), response.text
    assert response.elapsed.total_seconds() > READ_TIMEOUT_S


def test_a_body_cut_short_is_counted_as_the_client_got_it_not_as_a_400(gateway: int) -> None:
    """A body that stops is answered 408 by the protocol, one whose client hangs up gets nothing
    (499); the app, still reading, is told the connection closed and answered 400 "error parsing
    the body" to nobody, and that 400 was what /metrics and the log counted for both."""
    metrics_url = f"http://127.0.0.1:{gateway}/metrics"

    def count(status: str) -> float:
        return metric_sum(scrape(metrics_url), "gateway_http_requests_total", route=CHAT, status=status)

    before = {status: count(status) for status in ("400", "408", "499")}
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    with _connect(gateway) as sock:
        sock.sendall(head + b"Content-Length: 1000\r\n\r\n" + b'{"model":')
        assert _status_and_error(_read_until_closed(sock))[0] == 408
    with _connect(gateway) as sock:
        sock.sendall(head + b"Content-Length: 1000\r\n\r\n" + b'{"model":')
        time.sleep(0.3)  # the app is reading the body
    deadline = time.monotonic() + 5
    while count("499") == before["499"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {status: count(status) - before[status] for status in before} == {"400": 0, "408": 1, "499": 1}


def test_a_connection_that_never_sends_a_byte_is_closed_after_the_keep_alive(gateway: int) -> None:
    with _connect(gateway) as sock:
        started = time.monotonic()
        assert _read_until_closed(sock) == b""
    assert KEEP_ALIVE_S - 0.1 < time.monotonic() - started < KEEP_ALIVE_S + 3


def test_a_trailing_slash_is_404_never_a_redirect_built_from_the_host(gateway: int) -> None:
    response = httpx.post(f"http://127.0.0.1:{gateway}/v1/chat/completions/", content=_chat("slow"),
                          headers={"host": "evil.example", "content-type": "application/json"}, timeout=10)  # fmt: skip
    assert response.status_code == 404 and "location" not in response.headers, response.headers
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
