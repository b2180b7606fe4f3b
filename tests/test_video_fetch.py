"""A video's frame URLs, fetched by a real encoder process from a real HTTP server.

A video's frames are fetched together. When one frame fails (a bad data URL, a URL that answers
404), the call fails at once; the other fetches must stop with it. They went on, each up to
ENCODER_FETCH_TIMEOUT_S, after the call had ended and the gateway had freed its admission slot:
a client repeating a bad video of 63 slow frame URLs made the encoder hold 63 more connections
per request, past every limit on requests in flight."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.errors import InvalidInput, TooLarge
from shared.sdk import EncoderClient
from tests.encoder_process import EncoderProcess
from tests.harness import RedisServer
from tests.http_server import QuietHandler, serving
from tests.images import png_bytes

pytestmark = pytest.mark.integration

SLOW_FRAMES = 6
TRICKLE_S = 8.0  # how long a slow frame takes to arrive, in full


class Trickle:
    """What the slow server saw: fetches begun, and those whose client hung up."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.begun = 0
        self.abandoned_at: list[float] = []


@pytest.fixture
def trickle() -> Iterator[tuple[str, Trickle]]:
    seen = Trickle()
    body = png_bytes(5)

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            if self.path == "/missing.png":  # answers once the slow fetches are under way
                time.sleep(1.0)
                self.send_error(404)
                return
            with seen.lock:
                seen.begun += 1
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            steps = 40
            try:
                for index in range(steps):
                    self.wfile.write(body[index * len(body) // steps : (index + 1) * len(body) // steps])
                    self.wfile.flush()
                    time.sleep(TRICKLE_S / steps)
            except OSError:  # the client hung up
                with seen.lock:
                    seen.abandoned_at.append(time.monotonic())

    with serving(Handler) as base_url:
        yield base_url, seen


@pytest.fixture
def encoder(checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path: Path) -> Iterator[EncoderProcess]:
    process = EncoderProcess(
        checkpoints["base"],
        redis_server.url,
        tmp_path / "encoder.log",
        ENCODER_ALLOW_PRIVATE_URLS="true",
        ENCODER_FETCH_TIMEOUT_S="30",
    )
    process.start()
    yield process
    process.kill()


def test_a_failed_frame_stops_the_fetches_of_the_others(encoder: EncoderProcess, trickle: tuple[str, Trickle]) -> None:
    base_url, seen = trickle
    frames: list[bytes | str] = [f"{base_url}/frame{i}.png" for i in range(SLOW_FRAMES)]
    with EncoderClient(encoder.target, timeout_s=60) as client:
        started = time.monotonic()
        with pytest.raises(InvalidInput, match="HTTP 404") as caught:
            client.encode_video([*frames, f"{base_url}/missing.png"])
        failed_at = time.monotonic()
    assert caught.value.param == f"frames[{SLOW_FRAMES}]"
    assert failed_at - started < TRICKLE_S / 2, "the missing frame should fail the call at once"
    assert seen.begun == SLOW_FRAMES
    # Every fetch begun is abandoned within a moment of the call's end, not left to finish.
    wait_until = failed_at + 3
    while len(seen.abandoned_at) < seen.begun and time.monotonic() < wait_until:
        time.sleep(0.05)
    assert len(seen.abandoned_at) == seen.begun, f"{seen.begun} fetches begun, {len(seen.abandoned_at)} abandoned"


def _noise_png(side: int, seed: int) -> bytes:
    """A PNG of about 3 x side^2 bytes (noise does not compress)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_a_videos_frames_together_stay_within_max_video_bytes(
    checkpoints: dict[str, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Each frame within ENCODER_MAX_IMAGE_BYTES, all of them fetched at once: 64 frame URLs could
    hold 64 x 20 MiB of downloads for one call. The frames' bytes together are bounded, charged as
    they arrive, whether fetched or sent."""
    frames = [_noise_png(120, seed) for seed in range(4)]  # ~43 KB each
    budget = sum(len(frame) for frame in frames[:2]) + 100  # two frames fit, three do not

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802  (http.server's name)
            body = frames[int(self.path.removeprefix("/frame").removesuffix(".png"))]
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    process = EncoderProcess(
        checkpoints["base"], redis_server.url, tmp_path / "encoder.log",
        ENCODER_ALLOW_PRIVATE_URLS="true", ENCODER_MAX_VIDEO_BYTES=str(budget),
    )  # fmt: skip
    process.start()
    try:
        with serving(Handler) as base_url, EncoderClient(process.target, timeout_s=60) as client:
            urls: list[bytes | str] = [f"{base_url}/frame{i}.png" for i in range(4)]
            for too_many in (urls, list(frames), [urls[0], frames[1], urls[2]]):
                with pytest.raises(TooLarge, match="ENCODER_MAX_VIDEO_BYTES") as caught:
                    client.encode_video(too_many)
                assert caught.value.param == "frames"
            assert client.encode_video(urls[:2]).grid_thw[0] == 1  # two frames: one temporal patch
            assert client.encode_video([frames[2], urls[3]]).grid_thw[0] == 1
    finally:
        process.kill()
