"""Prometheus metrics of the LLM service (served on LLM_METRICS_PORT): how often the pod cache saves
a Redis round trip and what a round trip costs when it does not, and where a request's time goes
before its first token."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BLOB_CACHE_HITS = Counter("llm_blob_cache_hits_total", "Stored embeddings answered from the pod's blob cache.")
BLOB_CACHE_MISSES = Counter("llm_blob_cache_misses_total", "Stored embeddings the pod's blob cache did not hold.")
BLOB_FETCH_SECONDS = Histogram(
    "llm_blob_fetch_seconds", "Time of one Redis round trip fetching a request's blobs (completed ones).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
)  # fmt: skip
BLOB_NOT_FOUND = Counter(
    "llm_blob_not_found_total", "Keys asked of Redis that it did not hold (expired or never stored)."
)
# The stages of one Generate call, so the fixed cost of the encode-once hop can be read apart from
# the engine's own work: media (cache lookup, Redis fetch, validation), prompt (chat template,
# media items), first_token (engine submit to first output) and stream (turning the engine's
# outputs into gRPC messages and sending them, summed over a completed call's messages).
REQUEST_STAGE_SECONDS = Histogram(
    "llm_request_stage_seconds", "Time of each stage of a Generate call (media, prompt, first_token, stream).", ["stage"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)  # fmt: skip
# Engine-agnostic load, for dashboards and autoscaling on either engine (vLLM's own
# vllm:num_requests_waiting exists only with vLLM): submitted to the engine and no token yet
# (queued or in prefill), and submitted and not finished.
REQUESTS_WAITING = Gauge("llm_requests_waiting", "Requests submitted to the engine that have no first token yet.")
REQUESTS_IN_ENGINE = Gauge("llm_requests_in_engine", "Requests submitted to the engine and not finished.")
ENGINE_FROZEN_OBJECTS = Gauge(
    "llm_engine_gc_frozen_objects",
    "Objects the engine's own processes (vLLM's workers) froze once warmed up; 0 for an in-process engine.",
)
STALL_LIMIT_SECONDS = Gauge(
    "llm_stall_limit_seconds",
    "Seconds the engine may owe progress before the service counts it as hung and exits (LLM_STALL_S, or sized "
    "at start-up from a timed prefill); 0: the watch is off.",
)
