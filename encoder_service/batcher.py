"""Micro-batching: concurrent requests share one model call.

The first item waits at most `max_wait_s` for others (up to `max_batch_size`),
then the whole batch runs once in a worker thread so the event loop stays free.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")
logger = logging.getLogger(__name__)


class MicroBatcher(Generic[In, Out]):
    def __init__(
        self,
        run_batch: Callable[[list[In]], list[Out]],
        max_batch_size: int,
        max_wait_s: float,
        on_batch: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_batch(batch_size, queue_depth_left)` is called before each batch runs (for metrics)."""
        self._run_batch = run_batch
        self._on_batch = on_batch
        self._max_batch_size = max_batch_size
        self._max_wait_s = max_wait_s
        self._queue: asyncio.Queue[tuple[In, asyncio.Future[Out]]] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        self.batches_run = 0

    def start(self) -> None:
        self._worker = asyncio.create_task(self._work(), name="micro-batcher")

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def submit(self, item: In) -> Out:
        """Queues one item and waits for its result (or the batch's exception)."""
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        await self._queue.put((item, future))
        return await future

    async def _collect(self) -> list[tuple[In, asyncio.Future[Out]]]:
        loop = asyncio.get_running_loop()
        batch = [await self._queue.get()]
        deadline = loop.time() + self._max_wait_s
        while len(batch) < self._max_batch_size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                async with asyncio.timeout(remaining):
                    batch.append(await self._queue.get())
            except TimeoutError:
                break
        return batch

    async def _work(self) -> None:
        while True:
            batch = [entry for entry in await self._collect() if not entry[1].done()]
            if not batch:
                continue
            if self._on_batch is not None:
                self._on_batch(len(batch), self._queue.qsize())
            try:
                results = await asyncio.to_thread(self._run_batch, [item for item, _ in batch])
            except Exception as error:  # the batch's failure is each caller's failure
                logger.exception("batch of %d failed", len(batch))
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            self.batches_run += 1
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
