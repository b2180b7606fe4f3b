"""The encoder's single flight (encoder_service/single_flight.py): one run per key, shielded from
callers that leave, and a failure nobody waits for anymore is not reported as never retrieved."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from encoder_service.single_flight import SingleFlight


class Failed(Exception):
    pass


async def _failing_after(release: asyncio.Event) -> int:
    await release.wait()
    raise Failed("the encode failed")


def test_a_failure_after_every_caller_left_is_not_reported_unretrieved() -> None:
    reported: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: reported.append(context))
        flight: SingleFlight[int] = SingleFlight()
        release = asyncio.Event()
        caller = asyncio.create_task(flight.run("k", lambda: _failing_after(release)))
        await asyncio.sleep(0)  # the run has started and the caller waits on it
        assert flight.joining("k")
        caller.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()
        for _ in range(3):  # the run fails; its done-callbacks run
            await asyncio.sleep(0)
        assert not flight.joining("k")
        gc.collect()  # a task's unretrieved exception is reported when the task is collected

    asyncio.run(scenario())
    gc.collect()
    assert [c.get("message") for c in reported] == []


def test_callers_share_one_run_and_each_gets_its_failure() -> None:
    async def scenario() -> None:
        flight: SingleFlight[int] = SingleFlight()
        release = asyncio.Event()
        starts = 0

        def start() -> Any:
            nonlocal starts
            starts += 1
            return _failing_after(release)

        callers = [asyncio.create_task(flight.run("k", start)) for _ in range(3)]
        await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(*callers, return_exceptions=True)
        assert starts == 1
        assert all(isinstance(result, Failed) for result in results)

    asyncio.run(scenario())


def test_a_caller_leaving_does_not_cancel_the_run_others_wait_on() -> None:
    async def scenario() -> None:
        flight: SingleFlight[int] = SingleFlight()
        release = asyncio.Event()

        async def succeed() -> int:
            await release.wait()
            return 7

        leaving = asyncio.create_task(flight.run("k", succeed))
        staying = asyncio.create_task(flight.run("k", succeed))
        await asyncio.sleep(0)
        leaving.cancel()
        release.set()
        assert await staying == 7
        assert flight.joining("k") is False

    asyncio.run(scenario())
