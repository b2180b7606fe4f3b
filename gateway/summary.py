"""One log line per request that does work (chat completions, encodes): model, media keys, tokens
in and out, time to first token, total time, status and, for a failed one, the error the client
was given (code and message), as fields of a JSON line.

The exchange (gateway.exchange) opens a RequestSummary for the request; the code that learns each
fact notes it on the summary in force (`current()`), and the exchange writes the line when the
request ends, however it ends. The summary travels in a context variable, so the tasks a request
starts (n > 1 choices, a streamed body) note on the same one.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from shared.logging_setup import FIELDS

logger = logging.getLogger("gateway.requests")


@dataclass
class RequestSummary:
    started: float = field(default_factory=time.perf_counter)
    model: str | None = None
    keys: list[str] = field(default_factory=list)  # the stored media the request used, in order
    tokens_in: int = 0  # prompt tokens (the same for every choice)
    tokens_out: int = 0  # generated tokens, summed over choices
    first_token_at: float | None = None  # perf_counter() at the first token of any choice
    error: str | None = None  # "<code>: <message>" of the first error the client was told of

    def note_keys(self, keys: Iterable[str]) -> None:
        self.keys.extend(key for key in keys if key not in self.keys)

    def note_first_token(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def note_usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.tokens_in = max(self.tokens_in, prompt_tokens)
        self.tokens_out += completion_tokens

    def note_error(self, code: str | None, message: str) -> None:
        """The first error wins: a later one (an error event after a failed stream) is its echo."""
        if self.error is None:
            self.error = f"{code or 'error'}: {message}"

    def fields(self, method: str, route: str, status: int) -> dict[str, Any]:
        ttft = None if self.first_token_at is None else round(self.first_token_at - self.started, 6)
        return {
            "method": method, "route": route, "status": status, "model": self.model, "keys": self.keys,
            "tokens_in": self.tokens_in, "tokens_out": self.tokens_out, "ttft_s": ttft,
            "total_s": round(time.perf_counter() - self.started, 6), "error": self.error,
        }  # fmt: skip


_current: contextvars.ContextVar[RequestSummary | None] = contextvars.ContextVar("request_summary", default=None)


def current() -> RequestSummary:
    """The summary of the request being served; a detached one outside any (notes go nowhere)."""
    return _current.get() or RequestSummary()


@contextmanager
def summarised() -> Iterator[RequestSummary]:
    """Opens the request's summary for the block; the caller writes it with `log_summary`."""
    summary = RequestSummary()
    token = _current.set(summary)
    try:
        yield summary
    finally:
        _current.reset(token)


def log_summary(summary: RequestSummary, method: str, route: str, status: int) -> None:
    fields = summary.fields(method, route, status)
    ttft = "-" if fields["ttft_s"] is None else f"{fields['ttft_s']:.3f}s"
    # Why a request failed is on its line: a 503 or a 400 says which store, engine or field.
    error = "" if summary.error is None else f" error={summary.error}"
    logger.info(
        "%s %s %d model=%s keys=%d tokens=%d/%d ttft=%s total=%.3fs%s", method, route, status, fields["model"],
        len(summary.keys), summary.tokens_in, summary.tokens_out, ttft, fields["total_s"], error, extra={FIELDS: fields},
    )  # fmt: skip
