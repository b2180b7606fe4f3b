"""Scenario 4, encoder batching and tower speed.

Service rows: one encoder service process on the benchmark checkpoint (the Qwen2-VL-2B tower
shape), called over gRPC with distinct 448x448 images so every call encodes: 8 concurrent Encode
calls against one at a time. The encoder's forward-pass counter shows whether the concurrent
calls really shared passes.

Tower rows: seconds per image of the vision tower's forward pass alone, ours against vLLM's, on
the same checkpoint, images and dtype, one image per pass, each after one untimed pass. Ours is
the running encoder service's own `encoder_forward_seconds` around each Encode call, so the tower
is timed in the process, thread and allocator set-up that serve requests; vLLM's is a stock vLLM
OpenAI server sent one chat request per image, one at a time, timed by the benchmark hook around
its Qwen2-VL `_process_image_input` (bench/vllm_hook). Neither counts decoding, resizing, transport
or (vLLM) prefill. The systems run one after another.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.client import run_sequential
from bench.outcome import ScenarioResult, Target
from bench.procs import ServiceGroup, grpc_serving, python_module, wait_until
from bench.stages import histogram_totals
from bench.stats import ratio
from bench.vllm_server import all_cores, start_vllm_server, wait_vllm_ready
from bench.weights import count_weights
from bench.workload import QUESTIONS, chat_body, image_url_part, make_images
from scripts.ports import free_port
from shared.sdk import AsyncEncoderClient, EncoderStats

CONCURRENCY = 8
TOWER_IMAGES = 4  # timed per tower at most (see _enough)
TOWER_SECONDS = 60.0
TOWER_ROWS = ("tower forward, ours", "tower forward, vLLM")
FORWARD_METRIC = "encoder_forward_seconds"


async def _encode_all(target: str, images: list[bytes], concurrent: bool) -> tuple[float, EncoderStats, EncoderStats]:
    async with AsyncEncoderClient(target, timeout_s=900) as encoder:
        before = await encoder.stats()
        start = time.perf_counter()
        if concurrent:
            await asyncio.gather(*(encoder.encode(image_bytes=image) for image in images))
        else:
            for image in images:
                await encoder.encode(image_bytes=image)
        elapsed = time.perf_counter() - start
        after = await encoder.stats()
    return elapsed, before, after


def _row(elapsed: float, before: EncoderStats, after: EncoderStats) -> dict[str, float]:
    encoded = after.images_encoded - before.images_encoded
    return {
        "images": encoded,
        "forward passes": after.forward_passes - before.forward_passes,
        "wall s": elapsed,
        "images/s": encoded / elapsed,
        "s/image": elapsed / encoded if encoded else float("nan"),
    }


def _tower_row(seconds: list[float]) -> dict[str, float]:
    """One forward pass per image: `wall s` is the sum of the passes alone."""
    total = sum(seconds)
    return {"images": len(seconds), "forward passes": len(seconds), "wall s": total,
            "images/s": ratio(len(seconds), total), "s/image": ratio(total, len(seconds))}  # fmt: skip


def _our_tower_seconds(target: str, metrics_url: str, images: list[bytes]) -> list[float]:
    """Seconds of the encoder service's tower per image, one Encode call at a time (its first pass
    has run), read from its own `encoder_forward_seconds`, until _enough."""
    seconds: list[float] = []
    for image in images:
        total_before, passes_before = histogram_totals(metrics_url, FORWARD_METRIC)
        asyncio.run(_encode_all(target, [image], concurrent=False))
        total_after, passes_after = histogram_totals(metrics_url, FORWARD_METRIC)
        if passes_after - passes_before != 1:
            raise RuntimeError(
                f"expected one tower pass for one new image, the encoder counted {passes_after - passes_before}"
            )
        seconds.append(total_after - total_before)
        if _enough(seconds):
            break
    return seconds


def _enough(seconds: list[float]) -> bool:
    """Timing stops at TOWER_IMAGES images or TOWER_SECONDS of passes: on 2 CPU cores without
    bfloat16 kernels one pass of vLLM's tower takes ~2 min, and passes of one size vary by <1%."""
    return len(seconds) >= TOWER_IMAGES or sum(seconds) >= TOWER_SECONDS


def _hook_seconds(times_dir: Path) -> list[tuple[int, float]]:
    """(images, seconds) of every tower call the benchmark hook recorded under `times_dir`."""
    calls = []
    for path in sorted(times_dir.glob("*.times")):
        for line in path.read_text().splitlines():
            images, seconds = line.split()
            calls.append((int(images), float(seconds)))
    return calls


def _vllm_tower_seconds(group: ServiceGroup, checkpoint: Path, dtype: str, images: list[bytes]) -> list[float]:
    """Seconds of vLLM's tower per image, one request at a time, after an untimed first image.

    --enforce-eager: vLLM runs its vision tower eagerly either way; without it, start-up compiles
    the language model and runs a profiling batch of dummy images through the tower (many minutes
    on a CPU without bfloat16 kernels). Every core, as our encoder has: by default vLLM's worker
    leaves one core to its scheduler, which on two cores halves its tower's speed.
    """
    port = free_port()
    weight_bytes = count_weights(checkpoint).total_bytes(dtype)
    service = start_vllm_server(group, "vllm-tower", "base", checkpoint, port, dtype, embeds_only=False,
                                weight_bytes=weight_bytes, weights=f"vision tower + language model, {dtype}",
                                eager=True, every_core=True)  # fmt: skip
    wait_vllm_ready(service, port, 900)
    times_dir = group.log_dir / "vllm-tower.encodes"  # where start_vllm_server points the hook
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    seconds: list[float] = []
    for index, image in enumerate(images):
        before = len(_hook_seconds(times_dir))
        request = (url, chat_body("base", image_url_part(image), QUESTIONS[0], max_tokens=1))
        load = asyncio.run(run_sequential([request], timeout_s=900))
        if load.errors:
            raise RuntimeError(f"vLLM refused a tower request: {load.errors[0]}")
        calls = _hook_seconds(times_dir)[before:]
        if [n for n, _ in calls] != [1]:
            raise RuntimeError(f"expected one tower call of one image, the hook saw {calls}")
        if index > 0:
            seconds.append(calls[0][1])
            if _enough(seconds):
                break
    return seconds


def run(
    redis_url: str, checkpoint: Path, dtype: str, log_dir: Path, nonce: int, sequential_images: int
) -> ScenarioResult:
    columns = ["images", "forward passes", "wall s", "images/s", "s/image"]
    result = ScenarioResult("4", f"Encoder batching: {CONCURRENCY} concurrent Encode calls vs sequential; tower speed",
                            columns, {},
                            config={"checkpoint": str(checkpoint), "dtype": dtype, "image": "448x448 JPEG (256 tokens)",
                                    "sequential_images": sequential_images, "concurrent_images": CONCURRENCY,
                                    "tower_images_max": TOWER_IMAGES, "tower_seconds": TOWER_SECONDS})  # fmt: skip
    # images[0]: each system's untimed first pass; then the tower rows' images, the same for both.
    images = make_images(1 + TOWER_IMAGES + sequential_images + CONCURRENCY, nonce)
    tower_images = images[: 1 + TOWER_IMAGES]
    with ServiceGroup(log_dir / "s4") as group:
        _service_rows(result, group, redis_url, checkpoint, dtype, images, sequential_images)
    with ServiceGroup(log_dir / "s4") as baseline:
        result.rows[TOWER_ROWS[1]] = _tower_row(_vllm_tower_seconds(baseline, checkpoint, dtype, tower_images))
    result.memory = group.memory + baseline.memory
    speedup = ratio(result.rows[f"{CONCURRENCY} concurrent"]["images/s"], result.rows["sequential"]["images/s"])
    result.ratios["concurrent / sequential images/s"] = speedup
    tower = ratio(result.rows[TOWER_ROWS[0]]["s/image"], result.rows[TOWER_ROWS[1]]["s/image"])
    result.ratios["tower s/image ours / vLLM"] = tower
    # The issue sets no number for batching; this only says batching does no harm. On CPU one pass
    # of 8 images costs what 8 passes of one do (measured 0.999x), so the bound leaves room for noise.
    result.targets.append(
        Target("concurrent / sequential images/s (sanity check, no issue target)", speedup, ">=", 0.95, "x")
    )
    result.targets.append(Target("tower forward s/image, ours / vLLM's", tower, "<=", 1.0, "x"))
    result.notes.append(
        f"tower rows: one image per forward pass after an untimed one, until {TOWER_IMAGES} images or "
        f"{TOWER_SECONDS:.0f} s of passes; ours by the encoder service's own {FORWARD_METRIC} around "
        "each Encode call (the process, threads and allocator that serve requests), vLLM's by bench/vllm_hook "
        "around _process_image_input of a stock vLLM OpenAI server (--enforce-eager, "
        f"its worker's threads on cores {all_cores()} as ours may use), one chat request per image"
    )
    result.chart["images/s"] = {name: row["images/s"] for name, row in result.rows.items()}
    return result


def _service_rows(
    result: ScenarioResult,
    group: ServiceGroup,
    redis_url: str,
    checkpoint: Path,
    dtype: str,
    images: list[bytes],
    sequential_images: int,
) -> None:
    """The encoder service's rows: its tower alone on images[1 : 1 + TOWER_IMAGES], then
    `sequential_images` Encode calls one at a time, then CONCURRENCY at once."""
    port, metrics_port = free_port(), free_port()
    env = {"ENCODER_CHECKPOINT": str(checkpoint), "ENCODER_PORT": str(port), "ENCODER_DTYPE": dtype,
           "ENCODER_REDIS_URL": redis_url, "ENCODER_LOG_LEVEL": "WARNING", "ENCODER_MAX_BATCH_SIZE": str(CONCURRENCY),
           "ENCODER_METRICS_PORT": str(metrics_port)}  # fmt: skip
    weights = count_weights(checkpoint).vision_bytes(dtype)
    encoder = group.start("encoder", python_module("encoder_service"), env, weights, f"vision tower, {dtype}")
    target = f"127.0.0.1:{port}"
    wait_until(encoder, grpc_serving(target), 600)
    asyncio.run(_encode_all(target, images[:1], concurrent=False))  # first pass allocates; not timed
    tower = _our_tower_seconds(target, f"http://127.0.0.1:{metrics_port}/metrics", images[1 : 1 + TOWER_IMAGES])
    first = 1 + TOWER_IMAGES
    result.rows["sequential"] = _row(
        *asyncio.run(_encode_all(target, images[first : first + sequential_images], False))
    )
    result.rows[f"{CONCURRENCY} concurrent"] = _row(
        *asyncio.run(_encode_all(target, images[first + sequential_images :], True))
    )
    result.rows[TOWER_ROWS[0]] = _tower_row(tower)
