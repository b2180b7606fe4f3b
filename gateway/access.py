"""Who may call the gateway (API keys) and how many chat completions run at once."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from gateway.metrics import IN_FLIGHT
from shared.errors import RateLimited, Unauthenticated


class ApiKeys:
    """Checks `Authorization: Bearer <key>`; no keys configured means open access."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    def check(self, authorization: str | None) -> None:
        if not self._keys:
            return
        scheme, _, presented = (authorization or "").partition(" ")
        # compare_digest against every key: the time taken says nothing about which was close.
        matches = [hmac.compare_digest(presented.strip().encode(), key) for key in self._keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise Unauthenticated("missing or invalid API key; send Authorization: Bearer <key>")


class Admission:
    """Counts chat completions and encodes in flight, together (an encode runs the vision tower,
    the costliest work behind the gateway); over the limit a new one gets 429 + Retry-After."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def enter(self) -> Callable[[], None]:
        """Takes a slot and returns its release, which frees the slot on its first call only:
        it can then be called from every path that ends a request without counting twice."""
        if self.in_flight >= self.limit:
            raise RateLimited(f"too many requests in flight (limit {self.limit}); retry shortly")
        self.in_flight += 1
        IN_FLIGHT.inc()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.in_flight -= 1
                IN_FLIGHT.dec()

        return release
