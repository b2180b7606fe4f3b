"""The gRPC SDK used wrongly or in bad moments, against a real encoder process: what a caller
gets must be a ServiceError that says what happened, or a ValueError / TypeError at once for an
argument no call could honour."""

from __future__ import annotations

import asyncio
import io
import math
import time
from pathlib import Path

import pytest
from PIL import Image

from scripts.ports import free_port
from shared.errors import DeadlineExceeded, Unavailable
from shared.sdk import AsyncEncoderClient, AsyncLLMClient, EncoderClient, InlineEmbedding, LLMClient, Message
from tests.encoder_process import EncoderProcess
from tests.images import data_url, png_bytes

pytestmark = pytest.mark.integration


# --- timeouts -------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [math.inf, 1e12, None], ids=["inf", "1e12", "none"])
def test_a_timeout_too_long_for_grpc_means_no_deadline(lone_encoder: EncoderProcess, timeout_s: float | None) -> None:
    """gRPC ends a call at once (DEADLINE_EXCEEDED, "Deadline Exceeded") when its timeout is past
    ~1e9 s; inf, the natural way to ask for no deadline, failed every call so."""
    with EncoderClient(lone_encoder.target, timeout_s=timeout_s) as client:
        assert client.stats().encoder_id

    async def async_stats() -> str:
        async with AsyncEncoderClient(lone_encoder.target, timeout_s=timeout_s) as client:
            return (await client.stats()).encoder_id

    assert asyncio.run(async_stats())


def test_a_deadline_that_passes_names_the_service_that_did_not_answer(lone_encoder: EncoderProcess) -> None:
    """It said only "Deadline Exceeded": which of a pipeline's services was slow, it did not say."""
    with EncoderClient(lone_encoder.target, timeout_s=1e-6) as client, pytest.raises(DeadlineExceeded) as raised:
        client.encode(image_bytes=png_bytes(4242))
    assert lone_encoder.target in str(raised.value) and "deadline" in str(raised.value)


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


# --- a client closed under its calls --------------------------------------------------------


def _slow_video() -> list[bytes]:
    """Frames whose decoding and resizing take the encoder seconds; a shade of their own, so that
    no earlier run has them stored."""
    shade = time.time_ns() % 250
    frames = []
    for index in range(48):
        buffer = io.BytesIO()
        Image.new("RGB", (2000, 2000), (shade, index, 7)).save(buffer, format="PNG")
        frames.append(buffer.getvalue())
    return frames


def test_an_async_client_closed_under_a_call_fails_it_unavailable(lone_encoder: EncoderProcess) -> None:
    """grpc.aio ends the calls of a closed channel with asyncio.CancelledError in tasks nobody
    cancelled: `except ServiceError` missed it and the caller's task ended as if cancelled. The
    blocking client, and a multiplexed generate, answer Unavailable "the client was closed"."""
    frames = _slow_video()

    async def scenario() -> tuple[BaseException | None, bool]:
        client = AsyncEncoderClient(lone_encoder.target, timeout_s=120)
        task = asyncio.create_task(client.encode_video(frames))
        await asyncio.sleep(0.5)
        assert not task.done(), "the call should still be under way"
        await client.close()
        await asyncio.wait([task], timeout=30)
        return (None if task.cancelled() else task.exception()), task.cancelled()

    error, cancelled = asyncio.run(scenario())
    assert not cancelled
    assert isinstance(error, Unavailable), repr(error)
    assert str(error) == f"encoder at {lone_encoder.target} is unavailable: the client was closed"


def test_cancelling_a_call_of_a_closed_client_still_cancels(lone_encoder: EncoderProcess) -> None:
    frames = _slow_video()

    async def scenario() -> bool:
        client = AsyncEncoderClient(lone_encoder.target, timeout_s=120)
        task = asyncio.create_task(client.encode_video(frames))
        await asyncio.sleep(0.5)
        task.cancel()
        await client.close()
        await asyncio.wait([task], timeout=30)
        return task.cancelled()

    assert asyncio.run(scenario())


# --- arguments of the wrong shape -----------------------------------------------------------


def test_one_frame_given_as_frames_is_a_type_error(lone_encoder: EncoderProcess) -> None:
    """A str is iterable: each character went as a frame URL, and the encoder answered "video has
    37894 frames; the limit is 64" for one data URL (bytes: one frame per byte, a TypeError on int)."""
    frame = data_url(png_bytes(31))
    with EncoderClient(lone_encoder.target) as client:
        with pytest.raises(TypeError, match="frames is a list of frames"):
            client.encode_video(frame)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="frames is a list of frames"):
            client.encode_video(png_bytes(31))  # type: ignore[arg-type]
        assert client.encode_video([frame]).grid_thw[0] == 1


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (["hi"], "messages is a list of Message, not of str"),
        ([Message("user", "hi")], r"Message.content is a list of parts, e.g. \['hi'\], not a str"),
        ([Message("user", [b"hi"])], "a content part is a str, ImageKey, VideoKey or InlineEmbedding, not bytes"),
        ([Message("user", [{"type": "text", "text": "hi"}])], "not dict"),
    ],
    ids=["str-message", "str-content", "bytes-part", "dict-part"],
)
def test_messages_of_the_wrong_shape_are_type_errors_naming_what_is_wanted(messages: list, message: str) -> None:
    """They were AttributeErrors ("'str' object has no attribute 'to_pb'"), or a str content went
    as one text part per character."""
    with LLMClient(f"127.0.0.1:{free_port()}") as client:
        with pytest.raises(TypeError, match=message):
            list(client.generate("ft-a", messages))


def test_an_inline_embedding_of_another_modality_is_a_value_error() -> None:
    """A modality other than "video" went as an image."""
    with pytest.raises(ValueError, match="'image' or 'video', not 'Video'"):
        InlineEmbedding(b"blob", "Video")  # type: ignore[arg-type]
