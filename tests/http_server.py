"""Real HTTP servers on loopback, for tests whose services fetch images by URL."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A request handler that keeps its access log out of the test output."""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base class's name)
        pass


@contextmanager
def serving(handler: Callable[..., http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serves `handler` on a free loopback port from a thread; yields the base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
