"""What the services export for Prometheus, scraped over HTTP as a service serves it: gRPC server
metrics with the labels gRPC dashboards expect (grpc_service, grpc_method, grpc_type, grpc_code),
and the time of every Redis round trip by command."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.grpc_metrics import serve_metrics
from shared.sdk import EncoderClient, ImageKey, LLMClient, Message, Sampling
from tests.harness import Stack, free_port
from tests.images import png_bytes


@pytest.fixture(scope="module")
def metrics_url() -> str:
    """/metrics of this process, served as each service's __main__ serves it (the test stack's
    services run in this process)."""
    port = free_port()
    serve_metrics(port)
    return f"http://127.0.0.1:{port}/metrics"


def _sample(url: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (0 when there is none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


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
    text = httpx.get(metrics_url, timeout=5).text
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
