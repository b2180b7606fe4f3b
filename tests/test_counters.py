"""Counters are kept once and exported from there: the encoder's GetStats and its /metrics read the
same counts, and the LLM service exports its blob cache's hits and misses, its Redis fetch latency
and the keys Redis did not hold. Scraped over HTTP from /metrics as a service serves it."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.errors import EmbeddingNotFound
from shared.grpc_metrics import serve_metrics
from shared.keys import embedding_key
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack, free_port
from tests.images import png_bytes

LLM_SAMPLES = (
    "llm_blob_cache_hits_total",
    "llm_blob_cache_misses_total",
    "llm_blob_fetch_seconds_count",
    "llm_blob_not_found_total",
)
ENCODER_SAMPLES = ("encoder_images_encoded_total", "encoder_cache_hits_total")


@pytest.fixture(scope="module")
def metrics_url() -> str:
    """/metrics of this process, served as each service's __main__ serves it (the test stack's
    services run in this process)."""
    port = free_port()
    serve_metrics(port)
    return f"http://127.0.0.1:{port}/metrics"


def _scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text)
        for sample in family.samples
    }
    return {name: samples[name] for name in names}  # KeyError: a metric is not exported


def test_llm_service_exports_blob_cache_hits_misses_fetch_time_and_missing_keys(stack: Stack, metrics_url: str) -> None:
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(6101)).key
        missing = embedding_key(encoder.stats().encoder_id, b"never stored (counters)", 1, 2)
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


def _stage_counts(url: str) -> dict[str, float]:
    return {
        sample.labels["stage"]: sample.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text)
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
