"""Micro-batching: concurrent requests share one model call.

A batch opens when its first item arrives and runs, in a worker thread so the event loop stays
free, as soon as it holds `max_batch_size` items or its wait is over:
- `max_wait_s` after its first item, for items nobody announced;
- up to `max_hold_s` after its first item while announced items are still being prepared.

Why announcements: the calls of a burst reach `submit` tens of milliseconds apart, because each
one first decodes and preprocesses its image (measured: 8 concurrent 448x448 images reached the
batcher over 50-80 ms on 2 busy cores), so a short wait sends the first image alone and the rest
in a second pass. A caller that takes `reserve()` before preparing its input tells the batcher
one more item is on its way; the batch then waits for exactly the items that exist, not for a
guessed interval. Items that arrive while a batch runs are queued for the next one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")
logger = logging.getLogger(__name__)

DEFAULT_MAX_HOLD_S = 0.5


@dataclass
class _Entry(Generic[In, Out]):
    item: In
    future: asyncio.Future[Out]
    arrived: float  # event-loop time


class Reservation(Generic[In, Out]):
    """One announced item: `async with batcher.reserve() as slot: ...; await slot.submit(item)`.

    Entering the block announces the item; leaving it without submitting (an error or a
    cancellation while preparing) withdraws the announcement, so no batch waits for it.
    """

    def __init__(self, batcher: MicroBatcher[In, Out]) -> None:
        self._batcher = batcher
        self._announced = False

    async def submit(self, item: In) -> Out:
        if not self._announced:
            raise RuntimeError("submit through a reservation only inside its `async with` block, once")
        self._announced = False
        return await self._batcher._enqueue(item, announced=True)

    async def __aenter__(self) -> Reservation[In, Out]:
        self._batcher._announce()
        self._announced = True
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._announced:
            self._announced = False
            self._batcher._withdraw()


class MicroBatcher(Generic[In, Out]):
    def __init__(
        self,
        run_batch: Callable[[list[In]], list[Out]],
        max_batch_size: int,
        max_wait_s: float,
        on_batch: Callable[[int, int], None] | None = None,
        max_hold_s: float = DEFAULT_MAX_HOLD_S,
    ) -> None:
        """`on_batch(batch_size, queue_depth_left)` is called before each batch runs (for metrics).

        `max_hold_s` bounds the wait for announced items (see the module docstring); it is never
        shorter than `max_wait_s`.
        """
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_wait_s
        self._max_hold_s = max(max_hold_s, max_wait_s)
        self._queue: deque[_Entry[In, Out]] = deque()
        self._announced = 0  # reserved items not queued yet
        self._changed = asyncio.Event()  # set on every arrival or withdrawal
        self._worker: asyncio.Task[None] | None = None
        self.batches_run = 0

    def start(self) -> None:
        self._worker = asyncio.create_task(self._work(), name="micro-batcher")

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    def reserve(self) -> Reservation[In, Out]:
        """A slot for an item the caller is about to prepare; see Reservation."""
        return Reservation(self)

    async def submit(self, item: In) -> Out:
        """Queues one item and waits for its result (or the batch's exception)."""
        return await self._enqueue(item, announced=False)

    async def _enqueue(self, item: In, announced: bool) -> Out:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Out] = loop.create_future()
        if announced:
            self._announced -= 1
        self._queue.append(_Entry(item, future, loop.time()))
        self._changed.set()
        return await future

    def _announce(self) -> None:
        self._announced += 1

    def _withdraw(self) -> None:
        self._announced -= 1
        self._changed.set()  # a batch held for this item stops waiting for it

    async def _collect(self) -> list[_Entry[In, Out]]:
        loop = asyncio.get_running_loop()
        while not self._queue:
            self._changed.clear()
            await self._changed.wait()
        opened = self._queue[0].arrived  # after a long batch, its wait may be over already
        while len(self._queue) < self._max_batch_size:
            limit = self._max_hold_s if self._announced > 0 else self._max_wait_s
            remaining = opened + limit - loop.time()
            if remaining <= 0:
                break
            self._changed.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
            except TimeoutError:
                break
        return [self._queue.popleft() for _ in range(min(len(self._queue), self._max_batch_size))]

    async def _work(self) -> None:
        while True:
            batch = [entry for entry in await self._collect() if not entry.future.done()]
            if not batch:
                continue
            if self._on_batch is not None:
                self._on_batch(len(batch), len(self._queue))
            try:
                results = await asyncio.to_thread(self._run_batch, [entry.item for entry in batch])
            except Exception as error:  # the batch's failure is each caller's failure
                logger.exception("batch of %d failed", len(batch))
                for entry in batch:
                    if not entry.future.done():
                        entry.future.set_exception(error)
                continue
            self.batches_run += 1
            for entry, result in zip(batch, results, strict=True):
                if not entry.future.done():
                    entry.future.set_result(result)
