"""Counters are kept once and exported from there: the encoder's GetStats and its /metrics read the
same counts, and the LLM service exports its blob cache's hits and misses, its Redis fetch latency
and the keys Redis did not hold. Scraped over HTTP from /metrics as a service serves it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.errors import EmbeddingNotFound
from shared.keys import embedding_key
from shared.sdk import AsyncLLMClient, EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack
from tests.images import png_bytes
from tests.metrics_text import exported, metric_sum, scrape

LLM_SAMPLES = (
    "llm_blob_cache_hits_total",
    "llm_blob_cache_misses_total",
    "llm_blob_fetch_seconds_count",
    "llm_blob_not_found_total",
)
ENCODER_SAMPLES = ("encoder_images_encoded_total", "encoder_cache_hits_total", "encoder_forward_seconds_count")


def _scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    text = scrape(url)
    assert set(names) <= exported(text), f"not exported: {set(names) - exported(text)}"
    return {name: metric_sum(text, name) for name in names}


def test_llm_service_exports_blob_cache_hits_misses_fetch_time_and_missing_keys(stack: Stack, metrics_url: str) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(6101)).key
        missing = embedding_key(encoder.stats().encoder_id, b"never stored (counters)", 1, 2, dtype="float32")
    before = _scrape(metrics_url, LLM_SAMPLES)
    with LLMClient(stack.llm_target("ft-a")) as llm:
        for _ in range(2):  # fetched from Redis (a miss), then answered by the pod cache (a hit)
            list(llm.generate("ft-a", [Message("user", [ImageKey(key), "hi"])], Sampling(max_tokens=1)))
        with pytest.raises(EmbeddingNotFound):
            list(llm.generate("ft-a", [Message("user", [ImageKey(missing), "hi"])], Sampling(max_tokens=1)))
    after = _scrape(metrics_url, LLM_SAMPLES)
    assert {name: after[name] - before[name] for name in LLM_SAMPLES} == {
        "llm_blob_cache_hits_total": 1,
        "llm_blob_cache_misses_total": 2,
        "llm_blob_fetch_seconds_count": 2,
        "llm_blob_not_found_total": 1,
    }


def test_encoder_stats_and_metrics_count_the_same_encodes(stack: Stack, metrics_url: str) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        stats_before, metrics_before = encoder.stats(), _scrape(metrics_url, ENCODER_SAMPLES)
        for _ in range(2):  # encoded, then found in Redis
            encoder.encode(image_bytes=png_bytes(6102))
        stats_after, metrics_after = encoder.stats(), _scrape(metrics_url, ENCODER_SAMPLES)
    assert stats_after.images_encoded - stats_before.images_encoded == 1
    assert stats_after.cache_hits - stats_before.cache_hits == 1
    assert metrics_after["encoder_images_encoded_total"] - metrics_before["encoder_images_encoded_total"] == 1
    assert metrics_after["encoder_cache_hits_total"] - metrics_before["encoder_cache_hits_total"] == 1
    # One tower pass timed: the encode ran one, the cache hit none.
    assert metrics_after["encoder_forward_seconds_count"] - metrics_before["encoder_forward_seconds_count"] == 1


def _stage_counts(url: str) -> dict[str, float]:
    return {
        sample.labels["stage"]: sample.value
        for family in text_string_to_metric_families(scrape(url))
        for sample in family.samples
        if sample.name == "llm_request_stage_seconds_count"
    }


def test_llm_service_times_each_stage_of_a_call(stack: Stack, metrics_url: str) -> None:
    """One observation per stage per Generate call, on both engines (ft-a vLLM, ft-b transformers)."""
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(6102)).key
    before = _stage_counts(metrics_url)
    for model in ("ft-a", "ft-b"):
        with LLMClient(stack.llm_target(model)) as llm:
            list(llm.generate(model, [Message("user", [ImageKey(key), "hi"])], Sampling(max_tokens=2)))
    after = _stage_counts(metrics_url)
    stages = ("media", "prompt", "first_token", "stream")
    assert {stage: after[stage] - before.get(stage, 0) for stage in stages} == dict.fromkeys(stages, 2)


def _load(url: str) -> tuple[float, float]:
    text = scrape(url)
    return metric_sum(text, "llm_requests_waiting"), metric_sum(text, "llm_requests_in_engine")


def _wait_for_load(url: str, wanted: tuple[float, float], what: str) -> None:
    deadline = time.monotonic() + 10
    while (load := _load(url)) != wanted:
        assert time.monotonic() < deadline, f"{what}: (waiting, in engine) = {load}, expected {wanted}"
        time.sleep(0.02)


def test_llm_load_gauges_count_queued_and_running_requests_and_return_to_zero(stack: Stack, metrics_url: str) -> None:
    """ft-b's transformers engine runs one generation at a time: while a long one runs, a second
    one waits for its first token. Either leaving (before or after its first token) takes it off
    both gauges, so they cannot drift up under clients that hang up."""
    long = Sampling(max_tokens=1990)  # seconds of decoding on its own: the closes below come first
    question = [Message("user", ["tell me everything"])]

    async def queue_behind_a_running_one() -> None:
        async with AsyncLLMClient(stack.llm_target("ft-b")) as llm:
            running = llm.generate("ft-b", question, long)
            await anext(running)
            queued = llm.generate("ft-b", question, long)
            first = asyncio.ensure_future(anext(queued))
            await asyncio.to_thread(_wait_for_load, metrics_url, (1, 2), "one running, one queued")
            first.cancel()  # the queued one leaves before its first token
            with contextlib.suppress(asyncio.CancelledError):
                await first
            await queued.aclose()
            await asyncio.to_thread(_wait_for_load, metrics_url, (0, 1), "the queued one left")
            await running.aclose()

    assert _load(metrics_url) == (0, 0)
    asyncio.run(queue_behind_a_running_one())
    _wait_for_load(metrics_url, (0, 0), "both left")
