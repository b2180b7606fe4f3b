"""Merging several async streams into one, tagged with each stream's index."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TypeVar, cast

T = TypeVar("T")
_END = object()


async def merge_indexed(streams: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items as they arrive, as (index, item). The first error cancels the others and is raised."""
    if len(streams) == 1:  # the common case: no tasks, errors surface directly
        async for only in streams[0]:
            yield 0, only
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put((index, error))
        await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, arrived = await queue.get()
            if arrived is _END:
                remaining -= 1
            elif isinstance(arrived, Exception):
                raise arrived
            else:
                yield index, cast(T, arrived)  # put by pump() as a T: neither _END nor an error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
