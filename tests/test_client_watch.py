"""gateway.client_watch's own rules, on one event loop: which cancellations it absorbs. The ASGI
`receive` it wraps is fed from a queue, as uvicorn feeds it; the live test against the running
stack is tests/test_faults.py::test_clients_that_leave_before_any_output_cancel_their_generations."""

from __future__ import annotations

import asyncio

import pytest
from starlette.types import Message

from gateway.client_watch import ClientWatch

BODY: Message = {"type": "http.request", "body": b"{}", "more_body": False}
DISCONNECT: Message = {"type": "http.disconnect"}


class Connection:
    """The server side of one exchange: what `receive` answers, in order, when it is sent."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        self.response_ended = False

    async def receive(self) -> Message:
        return await self.inbox.get()


async def serve(watch: ClientWatch, started: asyncio.Event) -> str:
    """An app that reads its body, then works until cancelled."""
    async with watch:
        assert await watch.receive() == BODY
        started.set()
        await asyncio.sleep(30)
        return "finished"
    return "stopped by the client"


async def serving_started() -> tuple[Connection, ClientWatch, asyncio.Task[str]]:
    """An exchange whose body was read, and whose app is at work."""
    connection, started = Connection(), asyncio.Event()
    await connection.inbox.put(BODY)
    watch = ClientWatch(connection.receive, lambda: connection.response_ended)
    serving = asyncio.create_task(serve(watch, started))
    await started.wait()
    return connection, watch, serving


async def test_a_client_leaving_mid_work_stops_the_work_quietly() -> None:
    connection, watch, serving = await serving_started()
    await connection.inbox.put(DISCONNECT)
    assert await asyncio.wait_for(serving, 2) == "stopped by the client"
    assert watch.client_left
    assert serving.cancelling() == 0  # nothing left pending on the task


async def test_a_cancellation_from_elsewhere_is_never_absorbed() -> None:
    connection, watch, serving = await serving_started()
    await connection.inbox.put(DISCONNECT)
    await asyncio.sleep(0)  # the watcher runs, and cancels: the serving task has not run since
    assert watch.client_left
    serving.cancel()  # a server shutting down, say, at the same moment
    with pytest.raises(asyncio.CancelledError):
        await serving


async def test_the_end_of_a_response_is_no_client_leaving() -> None:
    """uvicorn answers `receive` with http.disconnect once the response is complete too."""
    connection, watch, serving = await serving_started()
    connection.response_ended = True
    await connection.inbox.put(DISCONNECT)
    await asyncio.sleep(0.1)
    assert not serving.done() and not watch.client_left
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving


async def test_the_apps_own_reads_after_the_body_hear_of_the_client_leaving() -> None:
    connection = Connection()
    await connection.inbox.put(BODY)
    async with ClientWatch(connection.receive, lambda: connection.response_ended) as watch:
        assert await watch.receive() == BODY
        listening = asyncio.create_task(watch.receive())  # as Starlette's streaming response listens
        await asyncio.sleep(0.05)
        assert not listening.done()
        await connection.inbox.put(DISCONNECT)
        with pytest.raises(asyncio.CancelledError):  # the block itself is being stopped
            await asyncio.sleep(30)
    assert watch.client_left
    assert await asyncio.wait_for(listening, 1) == DISCONNECT
