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
one's wait must count, or a hung engine seen by sparse traffic would never be caught.

Requests are not the only work: an engine frozen while idle owes no request anything, and the next
request would wait the whole limit for it. So the LLM service also probes its engine every few
seconds (LLM_ENGINE_PROBE_S, llm_service/server.py) with a round trip the engine answers between
two of its steps; the probe is work in hand and its answer progress, under the same rule. So
what the watch catches is a compute that stops, not one that keeps turning without serving a
request (an engine whose scheduler starved every request would answer its probes).

An engine at work, probed, answers within a probe's interval and one step, so `stall_s` must
exceed the slowest step the compute legitimately takes (a forward pass of the largest input
allowed, the largest prefill chunk of an engine step on CPU); unprobed, the longest wait for a
token (a whole prompt's prefill). `stall_limit` sizes it from that step: ten times over, so that a
machine busier than at start-up, or a chunk deep into a long context, is no hung engine, and never
under a minute, so that timing noise on a fast machine is none either.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# stall_limit's rule: the limit is this many times the longest legitimate step, and at least MIN_STALL_S.
STEP_MARGIN = 10
MIN_STALL_S = 60.0


def stall_limit(longest_step_s: float) -> float:
    """The stall limit for a compute whose longest legitimate step takes `longest_step_s`."""
    return max(MIN_STALL_S, STEP_MARGIN * longest_step_s)


class ProgressWatch:
    """Counts work in hand and the time of the last progress. Safe to use from several threads
    (the encoder's passes run on worker threads)."""

    def __init__(self, what: str, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # names the compute in the reason: "the vision tower", "the engine"
        self.stall_s = stall_s  # 0: never stalled; may be set later (the LLM service times its engine first)
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
