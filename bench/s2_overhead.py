"""Scenario 2, overhead of our path: gateway -> LLM service, each image by its stored key, against
the same requests sent straight to a plain vLLM OpenAI server that has seen each image once and is
then given it by uuid only.

That is the strongest direct setup: vLLM's processor cache answers the uuid with no payload to
parse, and its prefix cache holds the image's KV, so what is left between the two is our hop
(HTTP parse and validation, gRPC to the LLM service, key look-up, prompt build, streaming back).
Both see the same pixels: our encoder encodes each image once (the gateway's encode API), the
direct server encodes it itself in the warm-up round, and the measured rounds send keys and uuids
only, so neither side encodes or moves an image while measured (the direct server's vision-tower
runs are counted to show it).

Both systems are up at once but never loaded at once: rounds of 32 concurrent requests alternate
between them, who goes first alternates too, and a pause between rounds lets vLLM's processes
stop spinning before the other system's round. Every round appends its number to the questions,
so each round prefills new text after a cached image prefix on both sides. A sequential pass
gives the overhead without queueing: one request at a time, the two systems taking turns request
by request after a pause, so the machine's drift hits both alike, and the overhead is the median
of the paired differences (request i of each is the same question about the same image). Each
system's CPU time per request (its processes and their children) is read from /proc around its
rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.client import LoadResult, RequestTiming, run_concurrent, run_sequential, stream_chat
from bench.cpu import cpu_seconds_by_process
from bench.our_stack import StackOptions, start_our_stack
from bench.outcome import ScenarioResult, Target
from bench.procs import Service, ServiceGroup
from bench.stages import stage_means_ms
from bench.stats import median_interval, ratio
from bench.vllm_server import encodes_counted, start_vllm_server, wait_vllm_ready
from bench.weights import count_weights
from bench.workload import QUESTIONS, chat_body, data_url, make_images
from scripts.ports import free_port

CONCURRENCY = 32
MAX_TOKENS = 16
MODEL = "bench-model"
IMAGES = 8
SETTLE_S = 1.5  # vLLM's engine processes spin ~1 s after their last message
# Unmeasured rounds first: prefix caches, connections, compiled graphs; and one stall that the direct
# server takes once, ~190 ms in its third burst after start (seen in every run on this machine, the
# tiny model: 387-412 ms against ~220 before and after). With one warm-up round it fell in the
# measured rounds and flattered ours by ~20% in a 4-round quick run.
WARM_ROUNDS = 3
OURS, DIRECT = "ours", "direct vLLM, uuid only"
COLUMNS = [
    "requests",
    "errors",
    "output tok/s",
    "p50 latency ms",
    "p95 latency ms",
    "p50 TTFT ms",
    "sequential p50 latency ms",
    "sequential p50 TTFT ms",
    "CPU ms / request",
]


@dataclass(frozen=True)
class OverheadOptions:
    checkpoint: Path
    quick: bool


@dataclass(frozen=True)
class System:
    url: str  # chat completions endpoint
    part: Callable[[str], dict[str, Any]]  # the image part naming a stored image by its key
    services: list[Service]


def image_side_px(checkpoint: Path) -> int:
    """The side of the largest square image the checkpoint's processor keeps unresized."""
    config = json.loads((checkpoint / "preprocessor_config.json").read_text())
    unit = config["patch_size"] * config["merge_size"]
    return int(math.isqrt(config["max_pixels"]) // unit) * unit


def _key_part(key: str) -> dict[str, Any]:
    return {"type": "image_embeds", "image_embeds": None, "uuid": key}


def _uuid_part(key: str) -> dict[str, Any]:
    # vLLM takes a uuid with no data when its processor cache holds the item (seen in warm-up).
    return {"type": "image_url", "image_url": None, "uuid": key}


def _requests(system: System, keys: list[str], round_: int, count: int) -> list[tuple[str, dict[str, Any]]]:
    requests = []
    for index in range(count):
        question = f"{QUESTIONS[(index // len(keys)) % len(QUESTIONS)]} ({round_})"
        requests.append((system.url, chat_body(MODEL, system.part(keys[index % len(keys)]), question, MAX_TOKENS)))
    return requests


async def _warm_up(base_urls: dict[str, str], images: list[bytes]) -> list[str]:
    """Encodes each image once through our gateway (its key), and lets the direct server encode and
    cache each one under that key as uuid, as a client would the first time it sends an image."""
    async with httpx.AsyncClient(timeout=900) as client:
        keys = []
        for image in images:
            reply = await client.post(f"{base_urls[OURS]}/v1/images/encode", json={"image_url": data_url(image)})
            reply.raise_for_status()
            keys.append(reply.json()["key"])
    first = [
        (f"{base_urls[DIRECT]}/v1/chat/completions",
         chat_body(MODEL, {"type": "image_url", "image_url": {"url": data_url(image)}, "uuid": key}, QUESTIONS[0], 1))
        for image, key in zip(images, keys, strict=True)
    ]  # fmt: skip
    load = await run_sequential(first)
    if load.errors:
        raise RuntimeError(f"the direct server's warm-up failed: {load.errors[0]}")
    return keys


async def _measure(
    systems: dict[str, System], keys: list[str], rounds: int, sequential: int
) -> tuple[dict[str, dict[str, LoadResult]], dict[str, dict[str, float]]]:
    """Each system's loads, and its CPU seconds per concurrent request by process."""
    runs: dict[str, dict[str, LoadResult]] = {name: {} for name in systems}
    cpu: dict[str, dict[str, float]] = {name: {} for name in systems}
    for round_ in range(WARM_ROUNDS + rounds):
        # Who goes first alternates, so drift in the machine's other load hits both alike.
        for name, system in list(systems.items())[:: 1 if round_ % 2 else -1]:
            await asyncio.sleep(SETTLE_S)
            before = cpu_seconds_by_process(system.services)
            load = await run_concurrent(_requests(system, keys, round_, CONCURRENCY))
            if round_ >= WARM_ROUNDS:
                runs[name][f"round {round_ - WARM_ROUNDS + 1}"] = load
                for label, seconds in cpu_seconds_by_process(system.services).items():
                    cpu[name][label] = cpu[name].get(label, 0.0) + seconds - before.get(label, 0.0)
    for name, load in (await _sequential_in_turns(systems, keys, WARM_ROUNDS + rounds, sequential)).items():
        runs[name]["sequential"] = load
    requests = rounds * CONCURRENCY
    return runs, {name: {label: s / requests for label, s in by.items()} for name, by in cpu.items()}


async def _sequential_in_turns(
    systems: dict[str, System], keys: list[str], round_: int, count: int
) -> dict[str, LoadResult]:
    """`count` requests per system, one at a time, the systems taking turns request by request (who
    goes first alternates), each on its own kept-alive connection. A pause before each request
    lets the other system's engine stop spinning. The wall time is the sum of the latencies."""
    requests = {name: _requests(system, keys, round_, count) for name, system in systems.items()}
    timings: dict[str, list[RequestTiming]] = {name: [] for name in systems}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(httpx.AsyncClient(timeout=300)) for name in systems}
        for index in range(count):
            for name in list(systems)[:: 1 if index % 2 else -1]:
                await asyncio.sleep(SETTLE_S)
                url, body = requests[name][index]
                timings[name].append(await stream_chat(clients[name], url, body))
    return {name: LoadResult(sum(t.latency_s for t in done), done) for name, done in timings.items()}


def paired_differences_ms(ours: LoadResult, direct: LoadResult, field: str = "latency_s") -> list[float]:
    """Ours minus direct in `field`, in ms, per request pair (same question, same image, sent in
    turn); pairs where either failed or has no value are left out."""
    return [
        (getattr(o, field) - getattr(d, field)) * 1e3
        for o, d in zip(ours.timings, direct.timings, strict=True)
        if not (o.error or d.error or math.isnan(getattr(o, field)) or math.isnan(getattr(d, field)))
    ]


def paired_overhead_ms(ours: LoadResult, direct: LoadResult, field: str = "latency_s") -> float:
    """Median of the paired differences (paired_differences_ms); NaN when no pair is left."""
    pairs = paired_differences_ms(ours, direct, field)
    return statistics.median(pairs) if pairs else float("nan")


def _merge(loads: list[LoadResult]) -> LoadResult:
    return LoadResult(sum(load.wall_s for load in loads), [t for load in loads for t in load.timings])


def _fill(
    result: ScenarioResult, runs: dict[str, dict[str, LoadResult]], cpu_by_process: dict[str, dict[str, float]],
    quick: bool,
) -> None:  # fmt: skip
    cpu = {name: sum(by_process.values()) for name, by_process in cpu_by_process.items()}
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
            "sequential p50 TTFT ms": sequential["ttft_p50_s"] * 1e3, "CPU ms / request": cpu[name] * 1e3,
        }  # fmt: skip
    (ours, _), (direct, _) = summary[OURS], summary[DIRECT]
    throughput = ratio(ours["output_tok_s"], direct["output_tok_s"])
    overhead_ms = (ours["latency_p50_s"] - direct["latency_p50_s"]) * 1e3
    sequential_ms = paired_overhead_ms(runs[OURS]["sequential"], runs[DIRECT]["sequential"])
    # One request at a time takes ~0.1 s and varies by several ms either way from the engines'
    # scheduling alone, so a median of a few dozen pairs is a few ms uncertain: the interval says
    # how far, and whether the target is within reach of the noise.
    pairs = paired_differences_ms(runs[OURS]["sequential"], runs[DIRECT]["sequential"])
    sequential_low, sequential_high = median_interval(pairs)
    result.ratios["throughput ours / direct"] = throughput
    result.ratios["p50 latency overhead ms (32 concurrent)"] = overhead_ms
    result.ratios["p50 latency overhead ms (sequential, paired)"] = sequential_ms
    result.ratios["p50 latency overhead ms (sequential, paired): 95% interval low"] = sequential_low
    result.ratios["p50 latency overhead ms (sequential, paired): 95% interval high"] = sequential_high
    result.ratios["p50 TTFT overhead ms (sequential, paired)"] = paired_overhead_ms(
        runs[OURS]["sequential"], runs[DIRECT]["sequential"], "ttft_s"
    )
    result.ratios["CPU per request ours / direct"] = ratio(cpu[OURS], cpu[DIRECT])
    if quick:  # the tiny model: the engine's work is small and our hop shows
        result.targets += [Target("throughput ours / direct vLLM (32 concurrent)", throughput, ">=", 0.95, "x"),
                           Target("p50 latency overhead (sequential, paired)", sequential_ms, "<=", 3.0, " ms")]  # fmt: skip
    else:
        result.targets += [Target("throughput ours / direct vLLM (32 concurrent)", throughput, ">=", 0.9, "x"),
                           Target("p50 latency overhead (32 concurrent)", overhead_ms, "<=", 5.0, " ms")]  # fmt: skip
    result.chart["output tok/s"] = {name: row["output tok/s"] for name, row in result.rows.items()}
    result.chart["p50 latency ms"] = {name: row["p50 latency ms"] for name, row in result.rows.items()}
    result.chart["CPU ms / request"] = {name: row["CPU ms / request"] for name, row in result.rows.items()}
    result.notes.append(
        f"sequential, paired latency overhead: median of {len(pairs)} pairs {sequential_ms:.1f} ms, 95% interval"
        f" [{sequential_low:.1f}, {sequential_high:.1f}] ms (order statistics of the paired differences)"
    )
    for name, by_process in cpu_by_process.items():  # where each system's CPU goes: the gap by process
        shares = sorted(by_process.items(), key=lambda item: -item[1])
        result.notes.append(f"{name}, CPU ms per request by process: "
                            + ", ".join(f"{label} {seconds * 1e3:.2f}" for label, seconds in shares))  # fmt: skip
    for name, (concurrent, sequential) in summary.items():
        if concurrent["errors"] or sequential["errors"]:
            errors = [t.error for load in runs[name].values() for t in load.timings if t.error]
            result.notes.append(f"{name}: {len(errors)} failed requests, first: {errors[0]}")


def run(stack: StackOptions, options: OverheadOptions, log_dir: Path, nonce: int) -> ScenarioResult:
    # Quick rounds last ~0.2 s, and a stall of either system's engine (a full garbage collection in
    # vLLM's CPU worker, whose heap vLLM does not freeze there: 0.3-0.8 s, seen in both) costs one
    # of them a whole round: more rounds, and more pairs, so that one stall moves the ratio less.
    rounds, sequential = (8, 48) if options.quick else (5, 32)
    side = image_side_px(options.checkpoint)
    title = f"Overhead: gateway -> LLM service ({stack.engine}) vs plain vLLM given each image by uuid only"
    config = {"checkpoint": str(options.checkpoint), "engine": stack.engine, "dtype": stack.dtype, "eager": stack.eager,
              "concurrency": CONCURRENCY, "rounds": rounds, "max_tokens": MAX_TOKENS, "sequential_requests": sequential,
              "images": f"{IMAGES} distinct {side}x{side} JPEGs"}  # fmt: skip
    result = ScenarioResult("2", title, COLUMNS, {}, config=config)
    weights = count_weights(options.checkpoint)
    began = time.monotonic()
    with ServiceGroup(log_dir / "s2") as group:
        port = free_port()
        # Both start at once (their start-up is mostly imports and, unless eager, torch.compile);
        # they are only ever loaded in turn.
        direct = start_vllm_server(group, "direct-vllm", MODEL, options.checkpoint, port, stack.dtype,
                                   embeds_only=False, weight_bytes=weights.total_bytes(stack.dtype),
                                   weights=f"vision tower + language model, {stack.dtype}", eager=stack.eager)  # fmt: skip
        ours = start_our_stack(group, stack, {MODEL: options.checkpoint}, encoder_checkpoint=options.checkpoint)
        wait_vllm_ready(direct, port, stack.start_timeout_s)
        config["startup_s"] = round(time.monotonic() - began, 1)
        base_urls = {OURS: ours.base_url, DIRECT: f"http://127.0.0.1:{port}"}
        keys = asyncio.run(_warm_up(base_urls, make_images(IMAGES, nonce, side)))
        direct_encodes = encodes_counted(group.log_dir / "direct-vllm.encodes")
        systems = {
            OURS: System(f"{ours.base_url}/v1/chat/completions", _key_part, [s for s in group.services if s is not direct]),
            DIRECT: System(f"{base_urls[DIRECT]}/v1/chat/completions", _uuid_part, [direct]),
        }  # fmt: skip
        config["warm_up_s"] = round(time.monotonic() - began - config["startup_s"], 1)
        runs, cpu = asyncio.run(_measure(systems, keys, rounds, sequential))
        measured_encodes = encodes_counted(group.log_dir / "direct-vllm.encodes") - direct_encodes
        stages = stage_means_ms(ours.metrics_urls)
        config["measure_s"] = round(time.monotonic() - began - config["startup_s"] - config["warm_up_s"], 1)
    result.memory = group.memory
    _fill(result, runs, cpu, options.quick)
    config["our stages, mean ms per request (warm-up included)"] = {label: round(ms, 3) for label, ms in stages.items()}
    result.notes += [
        "ours, mean ms per request (warm-up included): "
        + ", ".join(f"{label} {ms:.3f}" for label, ms in stages.items())
        + " (gateway:prepare = check the request, look up media, build messages; llm:media = pod cache or Redis,"
        " validation; llm:prompt = chat template; llm:first_token = engine submit to first output; llm:stream ="
        " turning the engine's outputs into gRPC messages and sending them; gateway:relay = turning those into"
        " SSE events and sending them)",
        f"direct vLLM: {direct_encodes} images encoded in its warm-up, {measured_encodes} while measured (uuid only)",
        "CPU ms / request: CPU time of the system's processes (ours: gateway, LLM service with its vLLM engine,"
        " idle encoder; direct: API server with its engine) over its concurrent rounds, per request",
    ]
    return result
