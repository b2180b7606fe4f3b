"""Scenario 2, overhead of our path: gateway -> LLM service (stored keys) against the same
requests sent straight to a plain vLLM OpenAI server with the embeddings inline.

Both systems are up at once but never loaded at once: rounds of 32 concurrent requests alternate
between them, and which goes first alternates too. The embeddings are random tensors of the
checkpoint's image shape, stored in Redis for ours and sent inline (torch.save, base64, as vLLM
documents) to the direct server, with the blob key as the item's uuid as our engine passes it, so
both prefix caches key the image alike; no encoder runs. Every round appends its number to the
questions, so each round prefills new text after a cached image prefix on both sides. A
sequential pass (one request at a time) adds the overhead without queueing.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import torch

from bench.client import LoadResult, run_concurrent, run_sequential
from bench.our_stack import StackOptions, start_our_stack
from bench.outcome import ScenarioResult, Target
from bench.procs import ServiceGroup
from bench.stages import stage_means_ms
from bench.stats import ratio
from bench.vllm_server import start_vllm_server, wait_vllm_ready
from bench.weights import count_weights
from bench.workload import QUESTIONS, chat_body
from encoder_service.blob_arrays import blob_from_tensors
from scripts.stack import free_port
from shared.blob import BlobRules, encode_blob
from shared.encoder_id import compute_encoder_id
from shared.keys import embedding_key

CONCURRENCY = 32
MAX_TOKENS = 16
MODEL = "bench-model"
COLUMNS = [
    "requests",
    "errors",
    "output tok/s",
    "p50 latency ms",
    "p95 latency ms",
    "p50 TTFT ms",
    "sequential p50 latency ms",
]


@dataclass(frozen=True)
class OverheadOptions:
    checkpoint: Path
    quick: bool


@dataclass(frozen=True)
class Image:
    key: str  # stored blob, for ours
    inline: dict[str, Any]  # image_embeds part, for the direct server


def _image_shape(checkpoint: Path) -> tuple[list[int], int]:
    """The grid of the largest image the checkpoint's processor makes, and the LM hidden size."""
    max_pixels = json.loads((checkpoint / "preprocessor_config.json").read_text())["max_pixels"]
    side = int(math.isqrt(max_pixels) // 28) * 2  # patches per side, a multiple of merge_size 2
    hidden = json.loads((checkpoint / "config.json").read_text())["text_config"]["hidden_size"]
    return [1, side, side], hidden


def store_images(checkpoint: Path, redis_url: str, count: int, dtype: str, nonce: int) -> list[Image]:
    grid, hidden = _image_shape(checkpoint)
    encoder_id = compute_encoder_id(checkpoint)
    rules = BlobRules(2, hidden, frozenset({encoder_id}))
    client = redis.Redis.from_url(redis_url)
    images = []
    for index in range(count):
        seed = nonce * 1000 + index
        generator = torch.Generator().manual_seed(seed)
        embeds = torch.randn((math.prod(grid) // 4, hidden), generator=generator).to(getattr(torch, dtype))
        data = encode_blob(blob_from_tensors(embeds, torch.tensor([grid]), encoder_id, "image"), rules)
        key = embedding_key(encoder_id, str(seed).encode(), 0, 0)
        client.set(key, data)
        buffer = io.BytesIO()
        torch.save(embeds, buffer)
        inline = {"image_embeds": base64.b64encode(buffer.getvalue()).decode(), "image_grid_thw": grid}
        # The same uuid our engine gives vLLM: both prefix caches then key the image alike.
        images.append(Image(key, {"type": "image_embeds", "image_embeds": inline, "uuid": key}))
    client.close()
    return images


def _requests(url: str, images: list[Image], ours: bool, round_: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    requests = []
    for index in range(count):
        image = images[index % len(images)]
        part = {"type": "image_embeds", "image_embeds": None, "uuid": image.key} if ours else image.inline
        question = f"{QUESTIONS[(index // len(images)) % len(QUESTIONS)]} ({round_})"
        requests.append((url, chat_body(MODEL, part, question, MAX_TOKENS)))
    return requests


async def _measure(
    urls: dict[str, str], images: list[Image], rounds: int, sequential: int
) -> dict[str, dict[str, LoadResult]]:
    runs: dict[str, dict[str, LoadResult]] = {name: {} for name in urls}
    for round_ in range(rounds + 1):  # round 0 warms both (prefix caches, connections, compiled graphs)
        # Who goes first alternates, so drift in the machine's other load hits both alike.
        for name, url in list(urls.items())[:: 1 if round_ % 2 else -1]:
            load = await run_concurrent(_requests(url, images, name == "ours", round_, CONCURRENCY))
            if round_:
                runs[name][f"round {round_}"] = load
    for name, url in urls.items():
        runs[name]["sequential"] = await run_sequential(_requests(url, images, name == "ours", rounds + 1, sequential))
    return runs


def _merge(loads: list[LoadResult]) -> LoadResult:
    return LoadResult(sum(load.wall_s for load in loads), [t for load in loads for t in load.timings])


def _fill(result: ScenarioResult, runs: dict[str, dict[str, LoadResult]]) -> None:
    summary = {}
    for name, by_round in runs.items():
        concurrent = _merge([load for label, load in by_round.items() if label != "sequential"]).summary()
        sequential = by_round["sequential"].summary()
        summary[name] = (concurrent, sequential)
        result.rows[name] = {
            "requests": concurrent["requests"], "errors": concurrent["errors"] + sequential["errors"],
            "output tok/s": concurrent["output_tok_s"], "p50 latency ms": concurrent["latency_p50_s"] * 1e3,
            "p95 latency ms": concurrent["latency_p95_s"] * 1e3, "p50 TTFT ms": concurrent["ttft_p50_s"] * 1e3,
            "sequential p50 latency ms": sequential["latency_p50_s"] * 1e3,
        }  # fmt: skip
    (ours, ours_seq), (direct, direct_seq) = summary["ours"], summary["direct vLLM"]
    throughput = ratio(ours["output_tok_s"], direct["output_tok_s"])
    overhead_ms = (ours["latency_p50_s"] - direct["latency_p50_s"]) * 1e3
    result.ratios["throughput ours / direct"] = throughput
    result.ratios["p50 latency overhead ms (32 concurrent)"] = overhead_ms
    result.ratios["p50 latency overhead ms (sequential)"] = (
        ours_seq["latency_p50_s"] - direct_seq["latency_p50_s"]
    ) * 1e3
    result.targets += [Target("throughput ours / direct vLLM", throughput, ">=", 0.9, "x"),
                       Target("p50 latency overhead (32 concurrent)", overhead_ms, "<=", 5.0, " ms")]  # fmt: skip
    result.chart["output tok/s"] = {name: row["output tok/s"] for name, row in result.rows.items()}
    result.chart["p50 latency ms"] = {name: row["p50 latency ms"] for name, row in result.rows.items()}
    for name, (concurrent, sequential) in summary.items():
        if concurrent["errors"] or sequential["errors"]:
            errors = [t.error for load in runs[name].values() for t in load.timings if t.error]
            result.notes.append(f"{name}: {len(errors)} failed requests, first: {errors[0]}")


def run(stack: StackOptions, options: OverheadOptions, log_dir: Path, nonce: int) -> ScenarioResult:
    rounds, sequential = (2, 8) if options.quick else (5, 24)
    title = f"Overhead: gateway -> LLM service ({stack.engine}) vs plain vLLM with inline image_embeds"
    config = {"checkpoint": str(options.checkpoint), "engine": stack.engine, "dtype": stack.dtype, "eager": stack.eager,
              "concurrency": CONCURRENCY, "rounds": rounds, "max_tokens": MAX_TOKENS, "sequential_requests": sequential}  # fmt: skip
    result = ScenarioResult("2", title, COLUMNS, {}, config=config)
    images = store_images(options.checkpoint, stack.redis_url, 8, stack.dtype, nonce)
    language = count_weights(options.checkpoint).language_bytes(stack.dtype)
    began = time.monotonic()
    with ServiceGroup(log_dir / "s2") as group:
        port = free_port()
        # Both start at once (their start-up is mostly imports and, unless eager, torch.compile);
        # they are only ever loaded in turn.
        direct = start_vllm_server(group, "direct-vllm", MODEL, options.checkpoint, port, stack.dtype, embeds_only=True,
                                   weight_bytes=language, weights=f"language model, {stack.dtype}", eager=stack.eager)  # fmt: skip
        ours = start_our_stack(group, stack, {MODEL: options.checkpoint}, encoder_checkpoint=None)
        wait_vllm_ready(direct, port, stack.start_timeout_s)
        config["startup_s"] = round(time.monotonic() - began, 1)
        urls = {
            "ours": f"{ours.base_url}/v1/chat/completions",
            "direct vLLM": f"http://127.0.0.1:{port}/v1/chat/completions",
        }
        runs = asyncio.run(_measure(urls, images, rounds, sequential))
        stages = stage_means_ms(ours.metrics_urls)
        config["measure_s"] = round(time.monotonic() - began - config["startup_s"], 1)
    config["stop_s"] = round(time.monotonic() - began - config["startup_s"] - config["measure_s"], 1)
    result.memory = group.memory
    _fill(result, runs)
    config["our stages, mean ms per request (warm-up included)"] = {label: round(ms, 2) for label, ms in stages.items()}
    result.notes.append(
        "ours, mean per request before the first token (ms): "
        + ", ".join(f"{label} {ms:.2f}" for label, ms in stages.items())
        + " (gateway:prepare = encode/look up media and build messages; llm:media = pod cache, Redis, validation;"
        " llm:prompt = chat template; llm:first_token = engine submit to first output)"
    )
    result.notes.append(
        "direct vLLM runs with --enable-mm-embeds and images limited to 0: like our engine, it never loads the vision tower"
    )
    return result
