"""Scenario 5, ours against vLLM's own encoder disaggregation (EPD) on scenario 1's workload:
3 fine-tunes x 8 questions x 4 images, 96 requests at once, max_tokens 16.

The peer, set up as vLLM documents it (bench/epd_servers.py): an encoder-only vLLM of the base
checkpoint and one consumer vLLM per fine-tune on one ECExampleConnector directory in /dev/shm,
driven by a proxy that follows vLLM's example protocol and routes by model (bench/epd_proxy.py).
Ours: the gateway, as scenario 1 runs it. EPD runs first, then ours, never together.

After each measurement the same checks run against the live system (bench/epd_checks.py,
bench/epd_ours_checks.py): where items are stored, an encode API, a forged and a truncated stored
item, an item never stored, what is left behind. Memory is read before them: a check may kill
an EPD consumer, and a dead process's peak is gone.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.client import LoadResult
from bench.epd_checks import EVICTION, TOPICS, check_epd, remove_storage, storage_left
from bench.epd_ours_checks import check_ours
from bench.epd_proxy import run_epd_concurrent
from bench.epd_servers import start_epd, stored_items
from bench.our_stack import StackOptions, start_our_stack
from bench.outcome import ScenarioResult, Target
from bench.procs import ServiceGroup, memory_of
from bench.s1_fanout import COLUMNS, IMAGES, MAX_TOKENS, OURS, FanoutOptions, fanout_requests, load_row, ours_load
from bench.stages import stage_means_ms
from bench.stats import percentile, ratio
from bench.vllm_server import all_cores, encodes_counted
from bench.workload import QUESTIONS, make_images

EPD = "EPD (vLLM encoder instance + a consumer per fine-tune)"
NONCE_OFFSET = 5  # scenario 1 draws its images from nonce and nonce + 1; these must be new to our Redis
SLOW_BF16 = (
    "skipped: this CPU has no oneDNN bfloat16 matmul (no AVX-512 or AMX), so vLLM's bfloat16 vision tower "
    "runs on torch's generic loop: EPD's encoder instance had not encoded its start-up image after five "
    "minutes. Run it with --dtype float32 here."
)


def _measure_epd(
    stack: StackOptions, options: FanoutOptions, group: ServiceGroup, images: list[bytes], result: ScenarioResult,
    storage: Path,
) -> tuple[LoadResult, dict[str, str]]:  # fmt: skip
    began = time.monotonic()
    epd = start_epd(group, options.base, options.finetunes, storage, stack.dtype,
                    eager=stack.eager, start_timeout_s=stack.start_timeout_s)  # fmt: skip
    result.config["EPD startup_s"] = round(time.monotonic() - began, 1)
    result.config["EPD encoder's cores"] = all_cores()  # its consumers: vLLM's default binding
    before, stored = {name: encodes_counted(path) for name, path in epd.count_dirs.items()}, stored_items(storage)
    bodies = [body for _, body in fanout_requests(epd.routes.decode_urls, images)]
    load = asyncio.run(run_epd_concurrent(epd.routes, bodies))
    runs = {name: encodes_counted(path) - before[name] for name, path in epd.count_dirs.items()}
    result.rows[EPD] = load_row(load, sum(runs.values()))
    hops = [t.encoded_s for t in load.ok]
    if hops:  # when the consumers could start: the encoder instance answers each request once stored
        result.notes.append(f"EPD, request sent -> its image's encoder output stored (the encoder hop): "
                            f"p50 {percentile(hops, 50):.2f} s, max {max(hops):.2f} s")  # fmt: skip
    result.notes.append(f"EPD vision-tower runs by process: {runs}; encoder outputs stored during the run: "
                        f"{stored_items(storage) - stored} files in {storage}")  # fmt: skip
    result.memory += [memory_of(service) for service in group.services]
    seen = asyncio.run(check_epd(epd, images[0]))
    return load, seen


def _run_epd(
    stack: StackOptions, options: FanoutOptions, log_dir: Path, images: list[bytes], result: ScenarioResult
) -> dict[str, str]:
    group = ServiceGroup(log_dir / "s5-epd")
    storage = Path("/dev/shm") / f"bench-epd-{os.getpid()}"  # the setup: the connector's files in RAM
    try:
        load, seen = _measure_epd(stack, options, group, images, result, storage)
    finally:
        group.close()
        left = storage_left(storage)
        remove_storage(storage)  # tmpfs: RAM until removed
    seen[EVICTION] = left
    if load.errors:
        result.notes.append(f"EPD: {len(load.errors)} failed requests, first: {load.errors[0]}")
    return seen


def _run_ours(
    stack: StackOptions, options: FanoutOptions, log_dir: Path, images: list[bytes], result: ScenarioResult
) -> dict[str, str]:
    group = ServiceGroup(log_dir / "s5-ours")
    try:
        began = time.monotonic()
        ours = start_our_stack(group, stack, options.finetunes, options.base)
        result.config["ours startup_s"] = round(time.monotonic() - began, 1)
        assert ours.encoder_target is not None
        urls = {name: f"{ours.base_url}/v1/chat/completions" for name in options.finetunes}
        load, counters = asyncio.run(ours_load(ours.encoder_target, urls, images))
        result.rows[OURS] = load_row(load, counters["images_encoded"])
        result.notes.append(f"ours: encoder {counters}; vision-tower runs inside our LLM services: "
                            f"{encodes_counted(ours.encode_count_dir)}")  # fmt: skip
        stages = stage_means_ms(ours.metrics_urls)  # prepare: up to the request's images encoded (or found)
        result.notes.append("ours, mean s per request: " + ", ".join(f"{k} {ms / 1e3:.2f}" for k, ms in stages.items()))
        result.memory += [memory_of(service) for service in group.services]
        seen = asyncio.run(check_ours(ours.base_url, stack.redis_url, next(iter(options.finetunes)), images[0]))
    finally:
        group.close()
    if load.errors:
        result.notes.append(f"ours: {len(load.errors)} failed requests, first: {load.errors[0]}")
    return seen


def run(stack: StackOptions, options: FanoutOptions, log_dir: Path, nonce: int) -> ScenarioResult:
    images = make_images(IMAGES, nonce + NONCE_OFFSET)
    title = (f"Ours vs vLLM's encoder disaggregation (EPD): {len(options.finetunes)} fine-tunes x "
             f"{len(QUESTIONS)} questions x {IMAGES} images")  # fmt: skip
    config = {"engine": stack.engine, "dtype": stack.dtype, "max_tokens": MAX_TOKENS,
              "image": "448x448 JPEG (256 tokens)", "order": "EPD, then ours",
              "EPD proxy": "in the load generator (bench/epd_proxy.py); each TTFT includes the encoder hop"}  # fmt: skip
    result = ScenarioResult("5", title, COLUMNS, {}, config=config)
    if stack.dtype == "bfloat16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        result.title += " (SKIPPED)"
        result.notes.append(SLOW_BF16)
        return result
    seen: dict[str, dict[str, str]] = {topic: {} for topic in TOPICS}
    for system, run_system in (("EPD", _run_epd), ("ours", _run_ours)):
        try:
            for topic, what in run_system(stack, options, log_dir, images, result).items():
                seen[topic][system] = what
        except Exception as error:  # keep the other system's numbers; the report says what broke
            result.title += f" ({system} FAILED)"
            result.notes.append(f"{system} failed: {error!r}"[:2000])
    for topic, by_system in seen.items():
        result.notes.append(f"check, {topic}: EPD: {by_system.get('EPD', 'not run')}. "
                            f"Ours: {by_system.get('ours', 'not run')}.")  # fmt: skip
    if EPD in result.rows and OURS in result.rows:
        _judge(result, result.rows[EPD], result.rows[OURS])
    return result


def _judge(result: ScenarioResult, epd: dict[str, Any], ours: dict[str, Any]) -> None:
    result.ratios.update({
        "wall EPD / ours": ratio(epd["wall s"], ours["wall s"]),
        "TTFT p50 EPD / ours": ratio(epd["TTFT p50 s"], ours["TTFT p50 s"]),
        "output tok/s ours / EPD": ratio(ours["output tok/s"], epd["output tok/s"]),
    })  # fmt: skip
    result.targets += [
        Target("wall ours / EPD", ratio(ours["wall s"], epd["wall s"]), "<=", 1.0, "x"),
        Target("TTFT p50 ours / EPD", ratio(ours["TTFT p50 s"], epd["TTFT p50 s"]), "<=", 1.0, "x"),
        Target(f"encodes performed by ours == distinct images ({IMAGES})", ours["encodes"], "==", IMAGES),
    ]
    if epd["encodes"] != IMAGES:
        result.notes.append(f"EPD ran its vision tower {epd['encodes']} times for {IMAGES} distinct images")
    result.chart["wall s"] = {EPD: epd["wall s"], OURS: ours["wall s"]}
    result.chart["TTFT p50 s"] = {EPD: epd["TTFT p50 s"], OURS: ours["TTFT p50 s"]}
    result.chart["encodes"] = {EPD: epd["encodes"], OURS: ours["encodes"]}
