"""Client-caused edge cases against a real encoder gRPC server and a real Redis: images the
resizer refuses, keys that are not embedding keys, pixel bounds past the server's limit, and a
huge image that must not hold up a small one."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from encoder_service.batcher import LanedBatcher
from encoder_service.server import EncoderServer, start_encoder_server
from encoder_service.settings import EncoderSettings
from shared.blob import decode_blob
from shared.errors import IncompatibleEncoder, InvalidEmbedding, InvalidInput
from shared.pb.encoder.v1 import encoder_pb2, encoder_pb2_grpc
from shared.sdk import AsyncEncoderClient, EncoderClient
from tests.harness import BackgroundLoop, RedisServer
from tests.images import png_bytes, with_orientation
from tests.model_fixtures import make_image

HUGE_SIDE = 2240  # 25,600 patches: seconds of forward pass even on the tiny tower (attention is quadratic)


def _start(background_loop: BackgroundLoop, **settings: object) -> EncoderServer:
    return background_loop.run(
        start_encoder_server(EncoderSettings(host="127.0.0.1", port=0, warmup_pixels=0, **settings))
    )


@pytest.fixture(scope="module")
def encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> Iterator[EncoderServer]:
    """An encoder with the default limits of the tiny checkpoint (max_pixels 50176)."""
    server = _start(background_loop, checkpoint=str(checkpoints["base"]), redis_url=redis_server.url)
    yield server
    background_loop.run(server.stop())


def _target(server: EncoderServer) -> str:
    return f"127.0.0.1:{server.port}"


# --- 1. images transformers cannot resize ---------------------------------------------------


def test_aspect_ratio_over_200_is_invalid_input_naming_ratio_and_limit(encoder: EncoderServer) -> None:
    with EncoderClient(_target(encoder)) as client:
        with pytest.raises(InvalidInput, match=r"201\.0.*200") as image_error:
            client.encode(image_bytes=png_bytes(1, (2010, 10)))
        with pytest.raises(InvalidInput, match=r"201\.0.*200") as frame_error:
            client.encode_video([png_bytes(1, (10, 2010)), png_bytes(2, (10, 2010))])
        # Exactly 200 is what transformers still accepts.
        assert client.encode(image_bytes=png_bytes(1, (400, 2))).grid_thw[0] == 1
    assert image_error.value.param == "image_bytes" and frame_error.value.param == "frames[0]"


def test_a_negative_pixel_bound_is_invalid_input_naming_that_bound(encoder: EncoderServer) -> None:
    """max_pixels=-5 was refused naming min_pixels."""
    with EncoderClient(_target(encoder)) as client:
        for field in ("min_pixels", "max_pixels"):
            with pytest.raises(InvalidInput, match="must not be negative") as caught:
                client.encode(image_bytes=png_bytes(1), **{field: -5})
            assert caught.value.param == field


# --- 2. GetEmbedding reads embeddings of this encoder, nothing else ---------------------------


def test_get_embedding_never_returns_a_value_that_is_not_one_of_its_blobs(
    encoder: EncoderServer, redis_server: RedisServer
) -> None:
    own_id = encoder.core.encoder_id
    digest = "ab" * 32
    planted = {
        "secret:api-token": InvalidInput,
        f"emb:v1:{own_id}:{digest}\n": InvalidInput,  # `$` would match before the newline
        f"emb:v1:{own_id}:{digest.upper()}": InvalidInput,
        f"emb:v1:other-encoder:{digest}": IncompatibleEncoder,
        f"emb:v1:{own_id}:{digest}": InvalidEmbedding,  # a well-formed key holding no blob
    }
    redis = redis_server.client()
    try:
        for key in planted:
            redis.set(key, b"hunter2-the-secret")
        with EncoderClient(_target(encoder)) as client:
            for key, error in planted.items():
                with pytest.raises(error) as raised:
                    client.get_embedding(key)
                assert "hunter2" not in str(raised.value) and raised.value.param == "key", key
            real = client.encode(image_bytes=png_bytes(5301))
            blob = decode_blob(client.get_embedding(real.key), encoder.core.rules)  # its own blobs still read back
            assert blob.num_tokens == real.num_tokens
    finally:
        redis.delete(*planted)


def test_a_bfloat16_and_a_float32_encoder_of_one_tower_never_share_a_blob(
    encoder: EncoderServer, checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> None:
    """One tower in two dtypes has one encoder id, which an LLM service accepts from both; so the key
    tells the dtypes apart. Without that, whichever encoder met an image first would decide the
    other's embeddings (a float32 blob served by a bfloat16 deployment, or the reverse)."""
    bfloat16 = _start(
        background_loop, checkpoint=str(checkpoints["base"]), redis_url=redis_server.url, dtype="bfloat16"
    )
    image = png_bytes(5302)
    try:
        with EncoderClient(_target(encoder)) as single, EncoderClient(_target(bfloat16)) as half:
            stored = {"float32": single.encode(image_bytes=image), "bfloat16": half.encode(image_bytes=image)}
            assert not stored["bfloat16"].cache_hit and stored["float32"].key != stored["bfloat16"].key
            assert stored["float32"].encoder_id == stored["bfloat16"].encoder_id
            for dtype, reply in stored.items():
                assert decode_blob(single.get_embedding(reply.key), encoder.core.rules).dtype == dtype
    finally:
        background_loop.run(bfloat16.stop())


def test_a_10k_character_key_is_invalid_argument_with_a_short_message(encoder: EncoderServer) -> None:
    key = f"emb:v1:{encoder.core.encoder_id}:" + "a" * 10_000
    with grpc.insecure_channel(_target(encoder)) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            encoder_pb2_grpc.EncoderServiceStub(channel).GetEmbedding(
                encoder_pb2.GetEmbeddingRequest(key=key), timeout=30
            )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(raised.value.details()) < 300 and "is not an embedding key" in raised.value.details()


# --- 3a. client pixel bounds are capped by the server --------------------------------------


def test_pixel_bounds_past_the_checkpoint_default_are_refused_naming_the_limit(encoder: EncoderServer) -> None:
    limit = encoder.core.vision.default_max_pixels
    image = png_bytes(5302)
    with EncoderClient(_target(encoder)) as client:
        with pytest.raises(InvalidInput, match=f"limit of {limit}") as too_big:
            client.encode(image_bytes=image, max_pixels=limit + 1)
        with pytest.raises(InvalidInput, match=f"limit of {limit}") as upscaled:
            client.encode(image_bytes=image, min_pixels=limit + 1)  # upscaling is as costly
        with pytest.raises(InvalidInput, match=f"limit of {limit}") as frame_too_big:
            client.encode_video([image, image], max_pixels=limit + 1)  # a frame's bound is the checkpoint's too
        with pytest.raises(InvalidInput, match="784"):
            client.encode(image_bytes=image, max_pixels=100)
        assert client.encode(image_bytes=image, max_pixels=limit // 4).num_tokens > 0  # lowering is fine
    assert too_big.value.param == "max_pixels" and frame_too_big.value.param == "max_pixels"
    assert upscaled.value.param == "min_pixels"


def test_video_frames_default_to_the_checkpoints_bounds_unless_the_operator_sets_them(
    encoder: EncoderServer, checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> None:
    """Frames are resized within the checkpoint's bounds, as AutoProcessor and vLLM resize them
    (tests/test_video.py compares the pixels and answers); ENCODER_VIDEO_MIN/MAX_PIXELS replace
    them. The encoder used qwen-vl-utils' 100,352..602,112 whatever the checkpoint said: 640x480
    frames became [2, 34, 46] where AutoProcessor makes [2, 12, 18] of them (tiny checkpoint)."""
    frames = [png_bytes(seed, (640, 480)) for seed in range(4)]
    with EncoderClient(_target(encoder)) as client:
        assert client.encode_video(frames).grid_thw == [2, 12, 18]
    configured = _start(
        background_loop, checkpoint=str(checkpoints["base"]), redis_url=redis_server.url,
        video_min_pixels=128 * 28 * 28, video_max_pixels=768 * 28 * 28,
    )  # fmt: skip
    try:
        with EncoderClient(_target(configured)) as client:
            assert client.encode_video(frames).grid_thw == [2, 34, 46]
    finally:
        background_loop.run(configured.stop())


def test_a_video_over_the_total_pixel_limit_is_refused_naming_its_frames(
    checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> None:
    """Per-frame bounds alone do not bound a video's cost: its frames together may hold
    ENCODER_MAX_VIDEO_TOTAL_PIXELS once resized. 224x224 frames keep their size (50,176 pixels)."""
    limit = 3 * 224 * 224
    server = _start(
        background_loop, checkpoint=str(checkpoints["base"]), redis_url=redis_server.url, max_video_total_pixels=limit
    )
    frames = [png_bytes(seed, (224, 224)) for seed in range(4)]
    try:
        with EncoderClient(_target(server)) as client:
            with pytest.raises(InvalidInput, match=f"4 frames, resized to 224x224 pixels each, hold 200704 pixels; "
                               f"the limit is {limit}") as too_many:  # fmt: skip
                client.encode_video(frames)
            assert too_many.value.param == "frames"
            assert client.encode_video(frames[:3]).grid_thw == [2, 16, 16]
            assert client.encode_video(frames, max_pixels=112 * 112).grid_thw == [2, 8, 8]  # smaller frames fit
    finally:
        background_loop.run(server.stop())


# --- 3b. a huge image does not hold up a small one -------------------------------------------


@pytest.fixture(scope="module")
def roomy_encoder(
    checkpoints: dict[str, Path], redis_server: RedisServer, background_loop: BackgroundLoop
) -> Iterator[EncoderServer]:
    """An encoder whose operator allows images far above the checkpoint's default."""
    server = _start(
        background_loop,
        checkpoint=str(checkpoints["base"]),
        redis_url=redis_server.url,
        max_pixels_limit=HUGE_SIDE * HUGE_SIDE,
    )
    yield server
    background_loop.run(server.stop())


def test_a_small_image_finishes_while_a_huge_one_is_still_encoding(roomy_encoder: EncoderServer) -> None:
    huge_started = threading.Event()
    huge_done = threading.Event()
    huge_patches = HUGE_SIDE * HUGE_SIDE // 14**2

    def before(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if int(kwargs["grid_thw"].prod(dim=-1).max()) >= huge_patches:
            huge_started.set()

    def after(_module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if int(kwargs["grid_thw"].prod(dim=-1).max()) >= huge_patches:
            huge_done.set()

    tower = roomy_encoder.core.vision.tower
    handles = [
        tower.register_forward_pre_hook(before, with_kwargs=True),
        tower.register_forward_hook(after, with_kwargs=True),
    ]

    async def race() -> bool:
        async with AsyncEncoderClient(_target(roomy_encoder)) as client:
            huge = asyncio.create_task(
                client.encode(image_bytes=png_bytes(5303, (64, 64)), min_pixels=HUGE_SIDE**2, max_pixels=HUGE_SIDE**2)
            )
            # The small image arrives once the huge one's forward pass is under way.
            assert await asyncio.to_thread(huge_started.wait, 120)
            await client.encode(image_bytes=png_bytes(5304))
            small_first = not huge_done.is_set()
            assert (await huge).grid_thw == [1, HUGE_SIDE // 14, HUGE_SIDE // 14]
            return small_first

    try:
        assert asyncio.run(race()), "the small image waited for the huge one's forward pass"
    finally:
        for handle in handles:
            handle.remove()


async def test_batches_are_capped_by_cost_and_costly_items_take_their_own_lane() -> None:
    passes: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        passes.append(items)
        return [-n for n in items]

    batcher = LanedBatcher(run, cost=lambda n: n, large_cost=10, max_batch_size=8, max_wait_s=0.05, max_batch_cost=12)
    batcher.start()
    try:
        results = await asyncio.gather(*(batcher.submit(n) for n in (5, 5, 5, 50, 1)))
    finally:
        await batcher.aclose()
    assert results == [-5, -5, -5, -50, -1]
    # In arrival order, never skipping ahead: 5+5 fits 12, the third 5 opens the next pass.
    assert sorted(passes) == [[5, 1], [5, 5], [50]] and batcher.batches_run == 3


def test_a_photo_with_an_exif_rotation_is_encoded_upright(encoder: EncoderServer) -> None:
    """Orientation 6 ("rotate 90 clockwise to show"), as phone cameras save portrait photos: its
    embeddings equal those of the same picture stored already turned, over gRPC and Redis."""
    picture = make_image(61, 120, 60)  # 120 wide as stored, 60 wide as shown
    tagged = with_orientation(picture, 6, fmt="PNG")
    turned = io.BytesIO()
    picture.transpose(Image.Transpose.ROTATE_270).save(turned, "PNG")  # what orientation 6 means
    with EncoderClient(_target(encoder)) as client:
        blobs = [decode_blob(client.get_embedding(client.encode(image_bytes=data).key), encoder.core.rules)
                 for data in (tagged, turned.getvalue())]  # fmt: skip
    (_, height, width), (_, *turned_grid) = blobs[0].grid_thw.tolist()[0], blobs[1].grid_thw.tolist()[0]
    assert [height, width] == turned_grid and height > width, (height, width)  # portrait, as shown
    assert np.array_equal(blobs[0].embeds, blobs[1].embeds)
