"""Hung compute: work in hand and no progress for too long.

A process can be alive while its compute is not: a GPU that hangs (an Xid error, a stuck kernel)
or an engine process that is frozen leaves the service answering health checks while every
request waits forever. Nothing fails, so neither readiness nor a crash notices, and the pod is
never restarted. So each service counts progress where its compute produces it (the encoder: a
forward pass finished; the LLM service: a token out of the engine) and, while it has work in hand,
the time since the last progress. Past `stall_s` the compute counts as hung: the service reports
NOT_SERVING and exits non-zero to be restarted, as it does when its engine process dies.

Only time with work in hand counts, so a service idle for an hour is not stalled by its first
request; but that time adds up across pieces of work until progress comes: clients that give up
on a hung engine (the gateway's 300 s deadline, a client's own) leave without progress, and each
one's wait must count, or a hung engine seen by sparse traffic would never be caught. `stall_s`
must exceed the slowest step the compute legitimately takes (a forward pass of the largest input
allowed, an engine step of a long prefill on CPU).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class ProgressWatch:
    """Counts work in hand and the time of the last progress. Safe to use from several threads
    (the encoder's passes run on worker threads)."""

    def __init__(self, what: str, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # names the compute in the reason: "the vision tower", "the engine"
        self.stall_s = stall_s  # 0: never stalled
        self._clock = clock
        self._lock = threading.Lock()
        self._working = 0
        self._owed_s = 0.0  # time with work in hand since the last progress, up to `_since`
        self._since = clock()  # when `_owed_s` was last brought up to date

    def _settle(self, now: float) -> None:
        """Adds the time since `_since` to what is owed, if work was in hand meanwhile."""
        if self._working > 0:
            self._owed_s += now - self._since
        self._since = now

    @contextmanager
    def working(self) -> Iterator[None]:
        """The block holds work the compute owes progress on."""
        with self._lock:
            self._settle(self._clock())
            self._working += 1
        try:
            yield
        finally:
            with self._lock:
                self._settle(self._clock())
                self._working -= 1

    def progressed(self) -> None:
        with self._lock:
            self._owed_s, self._since = 0.0, self._clock()

    def stalled(self) -> str | None:
        """Why the compute counts as hung, or None."""
        if self.stall_s <= 0:
            return None
        with self._lock:
            self._settle(self._clock())
            owed, working = self._owed_s, self._working
        if working == 0 or owed <= self.stall_s:
            return None
        return (
            f"{self.what} made no progress for {owed:.1f}s of work in hand ({working} piece(s) now; "
            f"the limit, STALL_S, is {self.stall_s:g}s); taking it as hung"
        )

    async def until_stalled(self, poll_s: float) -> str:
        """Returns the reason once the compute counts as hung; polls every `poll_s`."""
        while (reason := self.stalled()) is None:
            await asyncio.sleep(poll_s)
        return reason
