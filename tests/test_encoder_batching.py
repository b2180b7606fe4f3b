"""Batched encoding: bit-identical to one image at a time, and one forward pass per burst.

An image's blob is stored under a key derived from the image alone, so its embeddings must not
depend on the images it happened to share a forward pass with (encoder_service/batch_invariant.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from PIL import Image
from transformers import Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel, VisionMlp

from encoder_service import fast_tower
from encoder_service.batcher import MicroBatcher
from encoder_service.fast_tower import CpuMatmul
from encoder_service.server import build_core
from encoder_service.settings import EncoderSettings
from encoder_service.video import VIDEO_MIN_PIXELS, preprocess_video
from encoder_service.vision import Preprocessed, VisionEncoder
from model_builders.bench import BENCH_VISION
from tests.harness import RedisServer
from tests.model_fixtures import make_image

# (width, height): grids of different sizes and aspect ratios, from 4x4 patches to the 16x16 maximum.
SIZES = [(100, 80), (140, 60), (56, 56), (224, 224), (60, 200)]
# Each order puts every image at another offset and beside other neighbours.
ORDERS = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [3, 0, 4, 2, 1], [2, 4], [1, 3, 0]]
# name -> (dtype, cpu_matmul): the served default (float32, linear layers in oneDNN), torch's own
# kernels, and bfloat16.
ENCODERS: dict[str, tuple[torch.dtype, CpuMatmul]] = {
    "float32": (torch.float32, "onednn"),
    "float32-exact": (torch.float32, "exact"),
    "bfloat16": (torch.bfloat16, "onednn"),
}


@pytest.fixture(scope="module")
def encoders(checkpoints: dict[str, Path]) -> dict[str, VisionEncoder]:
    return {name: VisionEncoder.load(str(checkpoints["base"]), "cpu", *how) for name, how in ENCODERS.items()}


@pytest.fixture(scope="module")
def items(encoders: dict[str, VisionEncoder]) -> list[Preprocessed]:
    return [encoders["float32"].preprocess(make_image(10 + i, w, h)) for i, (w, h) in enumerate(SIZES)]


@pytest.fixture(params=[2, 3], ids=lambda n: f"{n}threads")
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    # With 3 threads, per-thread chunks of element-wise kernels end mid-vector: the case that
    # per-image GEMMs alone did not make invariant.
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _bench_shaped_encoder(
    processor_of: VisionEncoder, dtype: torch.dtype, cpu_matmul: CpuMatmul = "onednn"
) -> VisionEncoder:
    """Qwen2-VL-2B's tower shape (embed 1280, 16 heads, mlp ratio 4, out 1536), one block, random weights."""
    torch.manual_seed(0)
    tower = Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(**{**BENCH_VISION, "depth": 1}))
    return VisionEncoder(tower.to(dtype).eval(), processor_of.processor, torch.device("cpu"), dtype, cpu_matmul)


def _assert_batches_equal_singles(encoder: VisionEncoder, items: list[Preprocessed]) -> None:
    singles = [encoder.encode_batch([item])[0] for item in items]
    assert len({s.shape for s in singles}) == len(items), "the images should differ in size"
    for order in ORDERS:
        batched = encoder.encode_batch([items[i] for i in order])
        for position, index in enumerate(order):
            assert batched[position].dtype == encoder.dtype and batched[position].device.type == "cpu"
            assert torch.equal(batched[position], singles[index]), f"image {index} in batch order {order}"


@pytest.mark.parametrize("name", ENCODERS)
def test_tiny_tower_batches_are_bit_identical_to_singles(
    encoders: dict[str, VisionEncoder], items: list[Preprocessed], name: str, threads: int
) -> None:
    _assert_batches_equal_singles(encoders[name], items)


@pytest.mark.parametrize("name", ENCODERS)
def test_bench_shaped_tower_batches_are_bit_identical_to_singles(
    encoders: dict[str, VisionEncoder], items: list[Preprocessed], name: str, threads: int
) -> None:
    _assert_batches_equal_singles(_bench_shaped_encoder(encoders[name], *ENCODERS[name]), items)


def test_video_and_images_in_one_batch_are_bit_identical_to_singles(
    encoders: dict[str, VisionEncoder], items: list[Preprocessed]
) -> None:
    """A video is one item of t*h*w patch rows (attention per frame): it too must not see its neighbours."""
    encoder = encoders["float32"]
    frames = [make_image(60 + i, 120, 90) for i in range(3)]
    video = preprocess_video(encoder.processor, frames, VIDEO_MIN_PIXELS // 4, VIDEO_MIN_PIXELS // 4)
    assert int(video[1][0, 0]) == 2
    _assert_batches_equal_singles(encoder, [items[0], video, items[3], items[1], items[4]])


def test_batched_rows_equal_transformers_image_features_of_each_image_alone(
    encoders: dict[str, VisionEncoder], items: list[Preprocessed], checkpoints: dict[str, Path]
) -> None:
    """cpu_matmul="exact": no tolerance, each image's rows in a batch are what the stock model gives
    for it alone. The default (oneDNN linear layers): within float rounding of them, measured
    ~1e-6 apart on this tiny tower, and still not the same bits (or the patch did nothing)."""
    exact = encoders["float32-exact"].encode_batch(items)
    served = encoders["float32"].encode_batch(items)
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoints["base"]).eval()
    with torch.inference_mode():
        for (pixel_values, grid), rows, fast in zip(items, exact, served, strict=True):
            (reference,) = model.model.get_image_features(pixel_values, grid).pooler_output
            assert rows.shape == (int(grid.prod()) // 4, encoders["float32"].hidden_size)
            assert torch.equal(rows, reference)
            assert fast.shape == rows.shape
            torch.testing.assert_close(fast, reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))
    assert not all(torch.equal(fast, rows) for fast, rows in zip(served, exact, strict=True))
    assert not torch.allclose(exact[0][:4], exact[1][:4])


def test_the_served_float32_tower_multiplies_in_onednn_and_exact_keeps_torchs_layers(
    encoders: dict[str, VisionEncoder],
) -> None:
    fc1 = encoders["float32"].tower.blocks[0].mlp.fc1
    assert vars(fc1)["forward"].__func__ is fast_tower._linear_in_float32
    assert "forward" not in vars(encoders["float32-exact"].tower.blocks[0].mlp.fc1)
    for block in encoders["float32"].tower.blocks:  # batch_invariant's per-image wrapper around make_fast's
        assert vars(block.mlp)["forward"].__wrapped__.__func__ is fast_tower._mlp_with_quick_gelu_in_fc1
    assert fc1.weight.is_mkldnn and not encoders["float32-exact"].tower.blocks[0].mlp.fc1.weight.is_mkldnn


@pytest.mark.parametrize("rows", [2, 3, 16, 257, 1024, 4096])
def test_packed_weights_give_the_plain_weights_products(rows: int) -> None:
    """fast_tower._pack_weight at the 2B tower's widest product: packing changes speed, not values.
    Bit for bit on the CPUs measured; other CPUs' kernels may sum in another order, so the test
    allows float rounding."""
    torch.manual_seed(rows)
    width = BENCH_VISION["embed_dim"]
    weight, bias = torch.randn(width * BENCH_VISION["mlp_ratio"], width), torch.randn(width * BENCH_VISION["mlp_ratio"])
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, fast_tower.PACKED_FOR_ROWS)
    x = torch.randn(rows, width)
    for activation in ("none", "swish"):
        plain = torch.ops.mkldnn._linear_pointwise(x, weight, bias, activation, [], "")
        fast = torch.ops.mkldnn._linear_pointwise(x, packed, bias, activation, [], "")
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))


def test_quick_gelu_inside_fc1_matches_the_stock_mlp_at_the_2b_tower_widths() -> None:
    """The fused MLP (fast_tower._mlp_with_quick_gelu_in_fc1) against transformers' VisionMlp on the
    2B-shaped tower's widths: within float rounding, for a bias-free fc2 too."""
    torch.manual_seed(0)
    mlp = VisionMlp(
        BENCH_VISION["embed_dim"], BENCH_VISION["embed_dim"] * BENCH_VISION["mlp_ratio"], "quick_gelu"
    ).eval()
    x = torch.randn(300, BENCH_VISION["embed_dim"])
    for bias in (mlp.fc2.bias, None):
        mlp.fc2.bias = bias
        with torch.inference_mode():
            stock, fused = mlp(x), fast_tower._mlp_with_quick_gelu_in_fc1(mlp, x)
        torch.testing.assert_close(fused, stock, rtol=1e-5, atol=1e-5 * float(stock.abs().max()))


@pytest.fixture(scope="module")
def widened(checkpoints: dict[str, Path]) -> VisionEncoder:
    """A bfloat16 encoder that multiplies in float32 (fast_tower.py) whatever kernels this CPU has."""
    with mock.patch.object(fast_tower, "widens_bfloat16_products", return_value=True):
        encoder = VisionEncoder.load(str(checkpoints["base"]), dtype=torch.bfloat16)
    assert "forward" in vars(encoder.tower.blocks[0].mlp.fc1)  # only make_fast sets a linear layer's own
    return encoder


def test_widened_bfloat16_batches_are_bit_identical_to_singles(
    widened: VisionEncoder, items: list[Preprocessed], threads: int
) -> None:
    """The float32 products run once per image too, in the tiny and in the 2B-shaped tower."""
    _assert_batches_equal_singles(widened, items)
    with mock.patch.object(fast_tower, "widens_bfloat16_products", return_value=True):
        bench_shaped = _bench_shaped_encoder(widened, torch.bfloat16)
    _assert_batches_equal_singles(bench_shaped, items)


def test_widened_bfloat16_rows_are_as_close_to_float32_as_transformers_bfloat16(
    widened: VisionEncoder,
    encoders: dict[str, VisionEncoder],
    items: list[Preprocessed],
    checkpoints: dict[str, Path],
) -> None:
    """bfloat16 rows cannot equal transformers' bfloat16 ones (products summed in another order). They
    must be no further from the float32 rows than transformers' bfloat16 forward is, and close to it:
    measured 2 bfloat16 ulps at most apart (0.25 on values up to ~32), both ~0.055 from float32 on average."""
    ours = widened.encode_batch(items)
    exact = encoders["float32-exact"].encode_batch(items)
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoints["base"], dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        for (pixel_values, grid), rows, truth in zip(items, ours, exact, strict=True):
            (reference,) = model.model.get_image_features(pixel_values, grid).pooler_output
            reference_error = (reference.float() - truth).abs()
            assert (rows.float() - truth).abs().mean() <= 1.2 * reference_error.mean()
            assert (rows.float() - reference.float()).abs().max() <= 2 * reference_error.max()


def test_bfloat16_rows_are_transformers_bfloat16_rows_where_products_are_not_widened(
    items: list[Preprocessed], checkpoints: dict[str, Path]
) -> None:
    """With bfloat16 matmul kernels (GPUs, CPUs with AVX-512 BF16 or AMX), the bfloat16 tower runs
    transformers' own ops, so each image alone gives get_image_features' bits. That needs the float32
    buffers transformers keeps (the rotary inverse frequencies) kept float32: rounded to bfloat16 they
    moved rows by up to 0.04 (bench/gpu on an H200)."""
    with mock.patch.object(fast_tower, "widens_bfloat16_products", return_value=False):
        encoder = VisionEncoder.load(str(checkpoints["base"]), dtype=torch.bfloat16)
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoints["base"], dtype=torch.bfloat16).eval()
    buffers = {name: b.dtype for name, b in model.model.visual.named_buffers()}
    assert {name: b.dtype for name, b in encoder.tower.named_buffers()} == buffers
    with torch.inference_mode():
        for item in items:
            (reference,) = model.model.get_image_features(*item).pooler_output
            assert torch.equal(encoder.encode_batch([item])[0], reference)


# --- the micro-batcher, on the real tiny encoder ------------------------------------------


class CountingEncoder:
    """The real encoder; records the size of every forward pass."""

    def __init__(self, encoder: VisionEncoder) -> None:
        self.encoder = encoder
        self.passes: list[int] = []

    def encode_batch(self, items: list[Preprocessed]) -> list[torch.Tensor]:
        self.passes.append(len(items))
        return self.encoder.encode_batch(items)


def _burst_image(index: int) -> Image.Image:
    return make_image(100 + index, 90 + 10 * index, 80)


async def _encode_burst(
    batcher: MicroBatcher[Preprocessed, torch.Tensor], encoder: VisionEncoder, count: int, stagger_s: float
) -> list[torch.Tensor]:
    """`count` concurrent callers that, like EncoderCore, announce, then preprocess, then submit.

    Caller i is ready `i * stagger_s` later than caller 0, well past the batcher's max_wait.
    """

    async def one(index: int) -> torch.Tensor:
        async with batcher.reserve() as slot:
            await asyncio.sleep(index * stagger_s)
            return await slot.submit(await asyncio.to_thread(encoder.preprocess, _burst_image(index)))

    return await asyncio.gather(*(one(i) for i in range(count)))


async def test_burst_of_eight_announced_encodes_runs_one_forward_pass(encoders: dict[str, VisionEncoder]) -> None:
    counting = CountingEncoder(encoders["float32"])
    batcher = MicroBatcher(counting.encode_batch, max_batch_size=8, max_wait_s=0.005, max_hold_s=30)
    batcher.start()
    try:
        results = await _encode_burst(batcher, counting.encoder, 8, stagger_s=0.02)
    finally:
        await batcher.aclose()
    assert counting.passes == [8] and batcher.batches_run == 1
    for index, rows in enumerate(results):
        (alone,) = counting.encoder.encode_batch([counting.encoder.preprocess(_burst_image(index))])
        assert torch.equal(rows, alone)


async def test_batch_size_stays_bounded(encoders: dict[str, VisionEncoder]) -> None:
    counting = CountingEncoder(encoders["float32"])
    batcher = MicroBatcher(counting.encode_batch, max_batch_size=4, max_wait_s=0.005, max_hold_s=30)
    batcher.start()
    try:
        await _encode_burst(batcher, counting.encoder, 10, stagger_s=0.0)
    finally:
        await batcher.aclose()
    assert sorted(counting.passes, reverse=True) == [4, 4, 2]


async def test_unannounced_items_wait_at_most_max_wait(encoders: dict[str, VisionEncoder]) -> None:
    counting = CountingEncoder(encoders["float32"])
    batcher = MicroBatcher(counting.encode_batch, max_batch_size=8, max_wait_s=0.05)
    batcher.start()
    item = counting.encoder.preprocess(make_image(7))
    try:
        together = await asyncio.gather(*(batcher.submit(item) for _ in range(3)))

        async def late() -> torch.Tensor:
            await asyncio.sleep(0.5)
            return await batcher.submit(item)

        await asyncio.gather(batcher.submit(item), late())
    finally:
        await batcher.aclose()
    assert counting.passes == [3, 1, 1]
    assert all(torch.equal(rows, together[0]) for rows in together)


async def test_announced_item_is_awaited_at_most_max_hold(encoders: dict[str, VisionEncoder]) -> None:
    counting = CountingEncoder(encoders["float32"])
    batcher = MicroBatcher(counting.encode_batch, max_batch_size=8, max_wait_s=0.005, max_hold_s=0.2)
    batcher.start()
    item = counting.encoder.preprocess(make_image(7))

    async def slow() -> torch.Tensor:
        async with batcher.reserve() as slot:
            await asyncio.sleep(2.0)
            return await slot.submit(item)

    try:
        slow_task = asyncio.create_task(slow())
        await asyncio.sleep(0)
        started = time.perf_counter()
        await batcher.submit(item)
        waited = time.perf_counter() - started
        await slow_task
    finally:
        await batcher.aclose()
    assert counting.passes == [1, 1] and 0.2 <= waited < 1.5


async def test_withdrawn_reservation_releases_the_batch(encoders: dict[str, VisionEncoder]) -> None:
    counting = CountingEncoder(encoders["float32"])
    batcher = MicroBatcher(counting.encode_batch, max_batch_size=8, max_wait_s=0.005, max_hold_s=30)
    batcher.start()
    item = counting.encoder.preprocess(make_image(7))

    async def fails_while_preparing() -> None:
        async with batcher.reserve():
            await asyncio.sleep(0.1)
            raise ValueError("not an image")

    try:
        failing = asyncio.create_task(fails_while_preparing())
        await asyncio.sleep(0)
        started = time.perf_counter()
        await batcher.submit(item)
        waited = time.perf_counter() - started
        with pytest.raises(ValueError, match="not an image"):
            await failing
    finally:
        await batcher.aclose()
    assert counting.passes == [1] and waited < 5


def _forward_grids(encoder: VisionEncoder) -> tuple[list[list[int]], torch.utils.hooks.RemovableHandle]:
    """Records the grid of every forward pass the real tower runs."""
    grids: list[list[int]] = []
    handle = encoder.tower.register_forward_pre_hook(
        lambda _module, args, kwargs: grids.append(kwargs["grid_thw"].tolist()), with_kwargs=True
    )
    return grids, handle


def test_warm_up_runs_one_forward_pass_capped_at_max_pixels(checkpoints: dict[str, Path]) -> None:
    encoder = VisionEncoder.load(str(checkpoints["base"]))
    grids, handle = _forward_grids(encoder)
    try:
        encoder.warm_up(10**9)  # far above the processor's max_pixels
        encoder.warm_up(56 * 56)
    finally:
        handle.remove()
    patch = encoder.processor.patch_size
    assert len(grids) == 2
    ((t, h, w),) = grids[0]
    assert t == 1 and h * w * patch**2 <= encoder.default_max_pixels
    assert grids[1] == [[1, 4, 4]]  # 56x56 pixels = 4x4 patches of 14


def test_build_core_warms_up_before_serving_unless_disabled(
    checkpoints: dict[str, Path], live_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    passes: list[int] = []
    original = VisionEncoder.warm_up

    def recorded(self: VisionEncoder, pixels: int) -> None:
        passes.append(pixels)
        original(self, pixels)

    monkeypatch.setattr(VisionEncoder, "warm_up", recorded)
    for warmup_pixels, expected in ((0, []), (64 * 64, [64 * 64])):
        passes.clear()
        settings = EncoderSettings(
            checkpoint=str(checkpoints["base"]), redis_url=live_redis.url, warmup_pixels=warmup_pixels
        )
        core = build_core(settings)
        assert passes == expected
        # The warm-up is no request: no batch, no image counted.
        assert core.batcher.batches_run == 0 and core.counters.images_encoded == 0
    assert EncoderSettings(checkpoint="x").warmup_pixels == 448 * 448  # on by default
