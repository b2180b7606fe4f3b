"""Prometheus metrics on all three services, JSON logs, and the request id carried
from the gateway through gRPC metadata into the services' log lines."""

from __future__ import annotations

import io
import json
import logging
import socket

import httpx
from openai import OpenAI

from shared.grpc_metrics import serve_metrics
from shared.logging_setup import JsonFormatter
from tests.harness import Stack, free_port
from tests.images import data_url, png_bytes
from tests.metrics_text import GENERATE_LABELS, metric_sum


def test_metrics_count_requests_encodes_and_rpcs(stack: Stack, openai_client: OpenAI) -> None:
    before = httpx.get(f"{stack.base_url}/metrics").text
    stream = openai_client.chat.completions.create(
        model="ft-a",
        max_tokens=3,
        stream=True,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png_bytes(401))}}]}],
    )
    assert [chunk for chunk in stream]
    after = httpx.get(f"{stack.base_url}/metrics").text
    route = {"route": "/v1/chat/completions", "status": "200"}
    assert (
        metric_sum(after, "gateway_http_requests_total", **route)
        == metric_sum(before, "gateway_http_requests_total", **route) + 1
    )
    assert metric_sum(after, "encoder_images_encoded_total") == metric_sum(before, "encoder_images_encoded_total") + 1
    generate = {**GENERATE_LABELS, "grpc_type": "server_stream", "grpc_code": "OK"}
    assert (
        metric_sum(after, "grpc_server_handled_total", **generate)
        == metric_sum(before, "grpc_server_handled_total", **generate) + 1
    )
    assert metric_sum(after, "gateway_ttft_seconds_count", model="ft-a") == (
        metric_sum(before, "gateway_ttft_seconds_count", model="ft-a") + 1
    )
    # The gateway's own stages and the LLM service's stages, one observation each for this chat.
    for name, stage in [("gateway_request_stage_seconds_count", stage) for stage in ("prepare", "relay")] + [
        ("llm_request_stage_seconds_count", stage) for stage in ("media", "prompt", "first_token", "stream")
    ]:
        assert metric_sum(after, name, stage=stage) == metric_sum(before, name, stage=stage) + 1, (name, stage)
    assert metric_sum(after, "gateway_completion_tokens_total", model="ft-a") >= 3
    assert metric_sum(after, "gateway_time_per_output_token_seconds_count", model="ft-a") == (
        metric_sum(before, "gateway_time_per_output_token_seconds_count", model="ft-a") + 1
    )


def test_a_request_answered_before_routing_is_counted_under_its_route(stack: Stack, strict_gateway: str) -> None:
    """A 413 by Content-Length and a 401 are answered before the router runs; they went under
    "unmatched", the label of unknown paths."""
    too_long = {"route": "/v1/chat/completions", "status": "413"}
    before = httpx.get(f"{stack.base_url}/metrics").text
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", stack.gateway_port), timeout=30) as conn:
        conn.sendall(head + b"Content-Length: 999999999\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 413")
    after = httpx.get(f"{stack.base_url}/metrics").text
    assert metric_sum(after, "gateway_http_requests_total", **too_long) == (
        metric_sum(before, "gateway_http_requests_total", **too_long) + 1
    )
    refused = {"route": "/v1/models", "status": "401"}
    before = httpx.get(f"{strict_gateway}/metrics").text
    assert httpx.get(f"{strict_gateway}/v1/models").status_code == 401
    after = httpx.get(f"{strict_gateway}/metrics").text
    assert metric_sum(after, "gateway_http_requests_total", **refused) == (
        metric_sum(before, "gateway_http_requests_total", **refused) + 1
    )


def test_services_serve_metrics_over_http() -> None:
    port = free_port()
    serve_metrics(port)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert "grpc_server_handled_total" in text and "redis_errors_total" in text


def test_request_id_reaches_the_encoder_log_as_json(stack: Stack) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("test"))
    logger = logging.getLogger("encoder_service")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        response = httpx.post(f"{stack.base_url}/v1/images/encode", json={"image_url": data_url(png_bytes(402))},
                              headers={"x-request-id": "rid-observability-1"})  # fmt: skip
    finally:
        logger.removeHandler(handler)
    assert response.status_code == 200 and response.headers["x-request-id"] == "rid-observability-1"
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    encoded = [line for line in lines if line["message"].startswith("encoded ")]
    assert encoded and encoded[0]["request_id"] == "rid-observability-1" and encoded[0]["level"] == "INFO"
