"""One run per key, however many callers ask for it at the same time.

The run is a task of its own, shielded from its callers: one that goes away (a client that
disconnects) does not cancel work others wait on. When every caller has gone before a run fails,
nobody awaits its exception; the run's own done-callback takes it, or asyncio would log "Task
exception was never retrieved" with a traceback for a failure each caller already had reported
(or had left before it came).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task[T]] = {}

    def joining(self, key: str) -> bool:
        """Whether a run for `key` is under way (a call now would join it)."""
        return key in self._running

    async def run(self, key: str, start: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """The result of the run under `key`: the one under way, else `start()`'s."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.create_task(start())
            self._running[key] = task
            task.add_done_callback(lambda done: self._settled(key, done))
        return await asyncio.shield(task)

    def _settled(self, key: str, task: asyncio.Task[T]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved: each caller still waiting gets it through its shield
