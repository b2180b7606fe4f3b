"""Image URL fetching through a real encoder gRPC server (real Redis), against loopback servers
the tests start: one deadline per fetch, failures that are the client's 400 and are never
retried, and the address check pinned to the connection (no DNS rebinding)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from encoder_service.server import EncoderServer, start_encoder_server
from encoder_service.settings import EncoderSettings
from scripts.ports import free_port
from shared.errors import ImageFetchFailed
from shared.sdk import EncoderClient
from tests.harness import BackgroundLoop, RedisServer
from tests.images import png_bytes

FETCH_TIMEOUT_S = 1.5
MARGIN_S = 1.5  # scheduling slack on busy CI cores; a retry or a per-read timeout costs far more
IMAGE = png_bytes(4401)  # a seed no other test of the session stores


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class CountingServer:
    """A TCP server on a loopback address that counts connections and answers with `behave`."""

    def __init__(self, behave: Callable[[socket.socket, bytes], None], host: str = "127.0.0.1", port: int = 0) -> None:
        self.connections = 0
        self.requests: list[bytes] = []  # request heads, in order
        self.closing = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer.connections += 1
                head = b""
                while b"\r\n\r\n" not in head and (chunk := self.request.recv(4096)):
                    head += chunk
                outer.requests.append(head)
                try:
                    behave(self.request, head)
                except OSError:  # the client went away: what a deadline does
                    pass

        self._server = _Server((host, port), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self._server.shutdown()
        self._server.server_close()


def _serve_image(sock: socket.socket, head: bytes) -> None:
    if head.startswith(b"GET /redirect "):
        sock.sendall(b"HTTP/1.1 302 Found\r\nLocation: /img.png\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        return
    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(IMAGE) + IMAGE)


@pytest.fixture
def servers() -> Iterator[list[CountingServer]]:
    started: list[CountingServer] = []
    yield started
    for server in started:
        server.close()


def _encoder(background_loop: BackgroundLoop, checkpoint: Path, redis_url: str, allow_private: bool) -> EncoderServer:
    settings = EncoderSettings(
        checkpoint=str(checkpoint),
        redis_url=redis_url,
        host="127.0.0.1",
        port=0,
        warmup_pixels=0,
        fetch_timeout_s=FETCH_TIMEOUT_S,
        allow_private_urls=allow_private,
    )
    return background_loop.run(start_encoder_server(settings))


@pytest.fixture(scope="module")
def open_encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> Iterator[str]:
    """An encoder that may fetch from loopback (so the tests' servers are reachable)."""
    server = _encoder(background_loop, checkpoints["base"], redis_server.url, allow_private=True)
    yield f"127.0.0.1:{server.port}"
    background_loop.run(server.stop())


@pytest.fixture(scope="module")
def strict_encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> Iterator[str]:
    """An encoder that refuses private and loopback addresses (the production default)."""
    server = _encoder(background_loop, checkpoints["base"], redis_server.url, allow_private=False)
    yield f"127.0.0.1:{server.port}"
    background_loop.run(server.stop())


def _timed_failure(target: str, url: str) -> tuple[ImageFetchFailed, float]:
    # The client's own deadline only keeps a broken server from hanging the test run.
    with EncoderClient(target, timeout_s=FETCH_TIMEOUT_S + 10) as client:
        started = time.monotonic()
        with pytest.raises(ImageFetchFailed) as raised:
            client.encode(image_url=url)
        return raised.value, time.monotonic() - started


# --- one deadline per fetch, a 400, never retried --------------------------------------------


def test_a_trickling_server_fails_the_fetch_at_its_deadline_once(
    open_encoder: str, servers: list[CountingServer]
) -> None:
    def trickle(sock: socket.socket, _head: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        while not trickling.closing.wait(0.5):  # one byte per 0.5 s: every read succeeds in time
            sock.sendall(b"x")

    trickling = CountingServer(trickle)
    servers.append(trickling)
    error, elapsed = _timed_failure(open_encoder, f"http://127.0.0.1:{trickling.port}/img.png")
    assert elapsed < FETCH_TIMEOUT_S + MARGIN_S and f"{FETCH_TIMEOUT_S}s" in error.message
    assert error.code == "invalid_image_url" and error.param == "image_url"
    assert trickling.connections == 1


def test_a_silent_server_fails_the_fetch_at_its_deadline_without_retries(
    open_encoder: str, servers: list[CountingServer]
) -> None:
    silent = CountingServer(lambda _sock, _head: silent.closing.wait(60))
    servers.append(silent)
    error, elapsed = _timed_failure(open_encoder, f"http://127.0.0.1:{silent.port}/img.png")
    assert elapsed < FETCH_TIMEOUT_S + MARGIN_S and error.code == "invalid_image_url"
    time.sleep(0.5)  # a retry, had there been one, would have connected by now
    assert silent.connections == 1


def test_a_refused_connection_and_a_bad_status_are_client_errors(
    open_encoder: str, servers: list[CountingServer]
) -> None:
    closed_port = free_port()  # nothing listens there, and no outgoing connection will take it
    error, _ = _timed_failure(open_encoder, f"http://127.0.0.1:{closed_port}/img.png")
    assert "could not be fetched" in error.message
    missing = CountingServer(lambda sock, _head: sock.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
    servers.append(missing)
    error, _ = _timed_failure(open_encoder, f"http://127.0.0.1:{missing.port}/img.png")
    assert "HTTP 404" in error.message and missing.connections == 1


# --- the checked address is the connected address ---------------------------------------------


class FlippingResolver:
    """socket.getaddrinfo that answers `answers[i]` on its i-th call for `host` (the last one after
    that); every other host resolves as usual."""

    def __init__(self, host: str, answers: list[str]) -> None:
        self.host, self.answers, self.calls = host, answers, 0
        self._real = socket.getaddrinfo

    def __call__(self, host: str | bytes | None, port: object, *args: object, **kwargs: object) -> list:
        name = host.decode() if isinstance(host, bytes) else host
        if name != self.host:
            return self._real(host, port, *args, **kwargs)
        address = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, int(port)))]


def test_dns_rebinding_never_reaches_the_loopback_server(
    strict_encoder: str, servers: list[CountingServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    inside = CountingServer(_serve_image)
    servers.append(inside)
    # Public for the check, loopback for whoever resolves the name a second time.
    resolver = FlippingResolver("rebind.example", ["93.184.216.34", "127.0.0.1"])
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    error, elapsed = _timed_failure(strict_encoder, f"http://rebind.example:{inside.port}/img.png")
    # The fetch went to the checked public address (unreachable here), or was refused; never inside.
    assert inside.connections == 0 and resolver.calls == 1
    assert error.code == "invalid_image_url" and elapsed < FETCH_TIMEOUT_S + MARGIN_S


def test_each_hop_connects_to_the_address_its_check_resolved_and_keeps_the_hostname(
    open_encoder: str, servers: list[CountingServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loopback is allowed here, so the fetch succeeds; the resolver answers each call with another
    loopback address (all of 127/8 is local), so the server that answers shows which answer the
    connection used: the first hop the first answer, the redirect hop the second."""
    first = CountingServer(_serve_image, "127.0.0.1")
    second = CountingServer(_serve_image, "127.0.0.2", first.port)
    servers.extend([first, second])
    resolver = FlippingResolver("images.example", ["127.0.0.1", "127.0.0.2", "127.0.0.3"])
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    with EncoderClient(open_encoder, timeout_s=30) as client:
        by_url = client.encode(image_url=f"http://images.example:{first.port}/redirect")
        by_bytes = client.encode(image_bytes=IMAGE)
    assert by_url.key == by_bytes.key
    assert resolver.calls == 2 and first.connections == 1 and second.connections == 1
    assert first.requests[0].startswith(b"GET /redirect ") and second.requests[0].startswith(b"GET /img.png ")
    host_header = f"host: images.example:{first.port}\r\n".encode()
    assert all(host_header in server.requests[0].lower() for server in (first, second))
