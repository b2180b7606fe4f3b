"""A video's frames are decoded one at a time, against a real encoder process.

ENCODER_MAX_DECODED_PIXELS bounds what one image may cost decoded; a video may have
ENCODER_MAX_VIDEO_FRAMES frames of that size. Holding them all decoded at once let a request of a
few MB (64 plain 8000x8000 PNGs compress to ~13 MB) ask the encoder for 12 GB. Each frame is now
resized before the next one is decoded, so a video costs one decoded frame at a time."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from shared.sdk import EncoderClient
from tests.encoder_process import EncoderProcess
from tests.harness import RedisServer

pytestmark = pytest.mark.integration

SIDE = 4000  # 16 M pixels a frame, 48 MB decoded as RGB
FRAMES = 32  # 1.5 GB decoded together
FRAME_MB = SIDE * SIDE * 3 / 2**20


def _plain_png(shade: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), (shade, 90, 200)).save(buffer, format="PNG", compress_level=9)
    return buffer.getvalue()


@pytest.fixture
def encoder(checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path: Path) -> Iterator[EncoderProcess]:
    process = EncoderProcess(checkpoints["base"], redis_server.url, tmp_path / "encoder.log")
    process.start()
    yield process
    process.kill()


def test_a_video_holds_one_decoded_frame_at_a_time(encoder: EncoderProcess) -> None:
    frames = [_plain_png(10 * i) for i in range(FRAMES)]
    assert sum(map(len, frames)) < 4 * 2**20  # a small request
    peak_before = encoder.status_kib("VmHWM")
    with EncoderClient(encoder.target, timeout_s=300) as client:
        # Frames resized small: the tower's own pass costs next to nothing.
        video = client.encode_video(frames, max_pixels=28 * 28 * 16)
    assert video.grid_thw[0] == FRAMES // 2
    grown_mb = (encoder.status_kib("VmHWM") - peak_before) / 1024
    # What one frame costs decoded and resized, with the allocator's arenas (~500 MB measured, the
    # same for 12 frames as for 24): not what all of them would take at once (1.1 GB for the first
    # 12 frames before, 2.9 GB for the 32).
    all_decoded_mb = FRAMES * FRAME_MB
    assert grown_mb < all_decoded_mb / 2, f"peak memory grew {grown_mb:.0f} MB for {FRAMES} frames of {FRAME_MB:.0f} MB"
