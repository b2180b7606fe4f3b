"""What the services export for Prometheus, scraped over HTTP as a service serves it: gRPC server
metrics with the labels gRPC dashboards expect (grpc_service, grpc_method, grpc_type, grpc_code),
the time of every Redis round trip by command, and the Grafana dashboard in deploy/dashboards,
whose every query names a metric the services export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack
from tests.images import png_bytes
from tests.metrics_text import metric_sum, scrape


def _sample(url: str, name: str, **labels: str) -> float:
    return metric_sum(scrape(url), name, **labels)


def test_grpc_server_metrics_name_service_method_and_call_type(stack: Stack, metrics_url: str) -> None:
    encode = {
        "grpc_service": "encoder.v1.EncoderService",
        "grpc_method": "/encoder.v1.EncoderService/Encode",
        "grpc_type": "unary",
        "grpc_code": "OK",
    }
    generate = {
        "grpc_service": "llm.v1.LLMService",
        "grpc_method": "/llm.v1.LLMService/Generate",
        "grpc_type": "server_stream",
        "grpc_code": "OK",
    }
    before = {
        "encode": _sample(metrics_url, "grpc_server_handled_total", **encode),
        "generate": _sample(metrics_url, "grpc_server_handled_total", **generate),
    }
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(7101)).key
    with LLMClient(stack.llm_target("ft-a")) as llm:
        list(llm.generate("ft-a", [Message("user", [ImageKey(key), "hi"])], Sampling(max_tokens=1)))
    assert _sample(metrics_url, "grpc_server_handled_total", **encode) == before["encode"] + 1
    assert _sample(metrics_url, "grpc_server_handled_total", **generate) == before["generate"] + 1
    timing = {k: v for k, v in generate.items() if k != "grpc_code"}
    assert _sample(metrics_url, "grpc_server_handling_seconds_count", **timing) >= 1
    # Every series has all the labels, whatever the call: none is left without a service or a type.
    text = scrape(metrics_url)
    rpc_samples = [
        sample
        for family in text_string_to_metric_families(text)
        if family.name.startswith("grpc_server_")
        for sample in family.samples
    ]
    assert rpc_samples
    for sample in rpc_samples:
        assert sample.labels["grpc_service"] and sample.labels["grpc_type"] in {"unary", "server_stream"}, sample


def test_every_redis_round_trip_is_timed_by_command(stack: Stack, metrics_url: str) -> None:
    commands = ("GETEX", "SET", "GET")
    before = {command: _sample(metrics_url, "redis_operation_seconds_count", operation=command) for command in commands}
    with EncoderClient(stack.encoder_target) as encoder:
        key = encoder.encode(image_bytes=png_bytes(7102)).key  # GETEX finds nothing, then SET
    with LLMClient(stack.llm_target("ft-b")) as llm:  # ft-b's pod cache has never seen it: one GET
        list(llm.generate("ft-b", [Message("user", [ImageKey(key), "hi"])], Sampling(max_tokens=1)))
    after = {command: _sample(metrics_url, "redis_operation_seconds_count", operation=command) for command in commands}
    assert {command: after[command] - before[command] for command in commands} == {"GETEX": 1, "SET": 1, "GET": 1}
    assert _sample(metrics_url, "redis_operation_seconds_sum", operation="SET") > 0


DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "dashboards" / "vlm-encode-once.json"
# PromQL's functions, aggregations and keywords the dashboard uses: any other word is a metric name.
PROMQL_WORDS = frozenset(
    {"sum", "rate", "irate", "increase", "histogram_quantile", "clamp_min", "avg", "max", "min", "count", "by",
     "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool"}
)  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r"\$\w+", "", expr)  # Grafana's variables ($__rate_interval)
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)  # label matchers, ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    words = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b", expr))
    return words - PROMQL_WORDS


def exported_names(metrics_text: str) -> set[str]:
    """Every series name the text exposes, counted or not yet (a labelled family has no samples
    until its first observation, but its HELP and TYPE say what it will expose)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in text_string_to_metric_families(metrics_text)
        for suffix in suffixes.get(family.type, ("",))
    }


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]


def test_metric_names_are_read_out_of_promql() -> None:
    expr = 'histogram_quantile(0.95, sum by (model, le) (rate(gateway_ttft_seconds_bucket{job="x"}[$__rate_interval])))'
    assert metric_names(expr) == {"gateway_ttft_seconds_bucket"}
    assert metric_names("sum(rate(a_total[5m])) / clamp_min(sum(rate(b_total[5m])), 1e-9)") == {"a_total", "b_total"}


def test_every_dashboard_query_names_a_metric_the_services_export(stack: Stack, metrics_url: str) -> None:
    exported = exported_names(scrape(metrics_url))
    queries = dashboard_queries()
    named = {name for expr in queries for name in metric_names(expr)}
    assert not {name for name in named if name not in exported}, "the dashboard reads metrics nobody exports"
    # What the dashboard is for: encodes and cache hits, TTFT and tokens/s per model, queue depths,
    # Redis latency and errors.
    assert {
        "encoder_images_encoded_total", "encoder_cache_hits_total", "llm_blob_cache_hits_total",
        "gateway_ttft_seconds_bucket", "gateway_completion_tokens_total", "encoder_batch_queue_depth",
        "grpc_server_in_flight", "redis_operation_seconds_bucket", "llm_blob_fetch_seconds_bucket",
        "redis_errors_total",
    } <= named  # fmt: skip
    assert any("by (model" in expr and "gateway_ttft_seconds_bucket" in expr for expr in queries)
    assert any("by (model)" in expr and "gateway_completion_tokens_total" in expr for expr in queries)
