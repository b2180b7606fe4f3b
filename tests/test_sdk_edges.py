"""The gRPC SDK used wrongly or in bad moments, against a real encoder process: what a caller
gets must be a ServiceError that says what happened, or a ValueError / TypeError at once for an
argument no call could honour."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.ports import free_port
from shared.errors import Unavailable
from shared.sdk import AsyncEncoderClient, AsyncLLMClient, EncoderClient, LLMClient, Message
from tests.encoder_process import EncoderProcess
from tests.harness import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EncoderProcess]:
    process = EncoderProcess(checkpoints["base"], redis_server.url, tmp_path_factory.mktemp("enc") / "encoder.log")
    process.start()
    yield process
    process.kill()


# --- timeouts -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [math.inf, 1e12, None], ids=["inf", "1e12", "none"])
def test_a_timeout_too_long_for_grpc_means_no_deadline(encoder: EncoderProcess, timeout_s: float | None) -> None:
    """gRPC ends a call at once (DEADLINE_EXCEEDED, "Deadline Exceeded") when its timeout is past
    ~1e9 s; inf, the natural way to ask for no deadline, failed every call so."""
    with EncoderClient(encoder.target, timeout_s=timeout_s) as client:
        assert client.stats().encoder_id

    async def async_stats() -> str:
        async with AsyncEncoderClient(encoder.target, timeout_s=timeout_s) as client:
            return (await client.stats()).encoder_id

    assert asyncio.run(async_stats())


@pytest.mark.parametrize("timeout_s", [0, -1, math.nan])
@pytest.mark.parametrize("client_type", [EncoderClient, LLMClient], ids=["encoder", "llm"])
def test_a_timeout_no_call_could_meet_is_a_value_error(client_type: type, timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        client_type("127.0.0.1:1", timeout_s=timeout_s)


def test_multiplexed_generate_without_a_deadline_is_a_call(tmp_path: Path) -> None:
    """timeout_s=None on a multiplexing client: its deadline timer took None (TypeError); the call
    is made, and here, with nothing listening, fails as calls do."""

    async def generate() -> None:
        async with AsyncLLMClient(f"127.0.0.1:{free_port()}", timeout_s=None, multiplex=2) as client:
            async for _ in client.generate("ft-a", [Message("user", ["hi"])]):
                pass

    with pytest.raises(Unavailable):
        asyncio.run(generate())
