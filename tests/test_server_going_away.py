"""A call the server cancels (it is stopping: its drain ran out, or its engine died) reaches the
client as Unavailable (503, retry elsewhere), not as an internal error (500), whether the call
is one of its own or multiplexed over GenerateMany. Real gRPC server and the SDK client, no mocks
of either."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from llm_service.multiplex import GenerateManyServicer
from shared.errors import Unavailable
from shared.grpc_server import start_server
from shared.grpc_subcalls import SubcallChain
from shared.pb.llm.v1 import llm_pb2, llm_pb2_grpc
from shared.sdk import AsyncLLMClient, Message

# Starts processes of its own (see the tiers in tests/conftest.py).
pytestmark = pytest.mark.integration


class SlowLLM(GenerateManyServicer, llm_pb2_grpc.LLMServiceServicer):
    """Waits on work (as Generate waits on its engine) until the server stops or the work is
    cancelled under it (as when vLLM's engine shuts down)."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.work: asyncio.Task[None] | None = None
        self.subcalls = SubcallChain([])

    async def Generate(
        self, request: llm_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[llm_pb2.GenerateChunk]:
        self.work = asyncio.create_task(asyncio.sleep(60))
        self.started.set()
        await self.work
        yield llm_pb2.GenerateChunk(text="never")

    def register(self, server: grpc.aio.Server, subcalls: SubcallChain) -> None:
        self.subcalls = subcalls
        llm_pb2_grpc.add_LLMServiceServicer_to_server(self, server)


@pytest.mark.parametrize("multiplex", [0, 2], ids=["own call", "multiplexed"])
@pytest.mark.parametrize("how", ["server stopped at once", "grace ran out", "work cancelled under the call"])
async def test_a_call_the_server_cancels_is_unavailable(how: str, multiplex: int) -> None:
    servicer = SlowLLM()
    running = await start_server(servicer.register, ["llm.v1.LLMService"], "127.0.0.1:0", 4 * 1024 * 1024)
    async with AsyncLLMClient(f"127.0.0.1:{running.port}", timeout_s=30, multiplex=multiplex) as client:

        async def consume() -> None:
            async for _ in client.generate("m", [Message("user", ["hi"])]):
                pass

        call = asyncio.create_task(consume())
        await asyncio.wait_for(servicer.started.wait(), 10)
        if how == "work cancelled under the call":
            assert servicer.work is not None
            servicer.work.cancel()
        else:
            await running.server.stop(0.0 if how == "server stopped at once" else 0.2)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(call, 10)
    await running.server.stop(0)
