"""One request, one trace, across the real stack's processes (tests/process_stack.py): the
gateway's HTTP span, the encoder's Encode and its Redis round trips, the LLM service's Generate,
its Redis fetch and its engine run, each the child of the span that caused it.

The services export as in production: OTEL_EXPORTER_OTLP_ENDPOINT names an OTLP/gRPC collector,
and their OTLP exporters send it batches of spans. The collector is this test process: a gRPC
server of OpenTelemetry's TraceService turns each exported span back into the SDK's ReadableSpan
and hands it to the SDK's InMemorySpanExporter, which the assertions read. Nothing in the services
knows it is being tested.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry import propagate, trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

from shared import tracing
from tests.images import data_url, png_bytes
from tests.process_stack import ProcessStack, process_stack


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(item) for item in value.array_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _readable(span: trace_pb2.Span, resource: Resource) -> ReadableSpan:
    trace_id = int.from_bytes(span.trace_id, "big")
    parent_id = int.from_bytes(span.parent_span_id, "big")
    return ReadableSpan(
        name=span.name,
        context=SpanContext(trace_id, int.from_bytes(span.span_id, "big"), False, TraceFlags(TraceFlags.SAMPLED)),
        parent=SpanContext(trace_id, parent_id, True) if parent_id else None,
        resource=resource,
        attributes=_attributes(span.attributes),
        kind=SpanKind(span.kind - 1),  # OTLP counts from SPAN_KIND_UNSPECIFIED = 0
        start_time=span.start_time_unix_nano,
        end_time=span.end_time_unix_nano,
    )


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace collector that keeps what it receives in an InMemorySpanExporter."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()

    def Export(  # noqa: N802  (the RPC's name)
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        for resource_spans in request.resource_spans:
            resource = Resource(_attributes(resource_spans.resource.attributes))
            spans = [_readable(s, resource) for scope in resource_spans.scope_spans for s in scope.spans]
            self.exporter.export(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(0)


@pytest.fixture(scope="module")
def traced_stack(
    checkpoints: dict[str, Path], collector: tuple[Collector, int], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessStack]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector[1]}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # the SDK's batch interval (5 s by default), read by the SDK itself
    }
    with process_stack(checkpoints, tmp_path_factory.mktemp("traced"), env=env) as running:
        yield running


def _tree(spans: list[ReadableSpan]) -> str:
    """The trace as an indented tree, for the failure message and the issue's closing note."""
    by_parent: dict[int | None, list[ReadableSpan]] = {}
    for span in sorted(spans, key=lambda s: s.start_time or 0):
        by_parent.setdefault(span.parent.span_id if span.parent else None, []).append(span)
    ids = {span.context.span_id for span in spans}
    roots = [span for span in spans if span.parent is None or span.parent.span_id not in ids]
    lines: list[str] = []

    def walk(span: ReadableSpan, depth: int) -> None:
        service = span.resource.attributes.get("service.name")
        lines.append(f"{'  ' * depth}{span.name} [{service}, {span.kind.name}]")
        for child in by_parent.get(span.context.span_id, []):
            walk(child, depth + 1)

    for root in roots:
        walk(root, 0)
    return "\n".join(lines)


@pytest.mark.e2e
def test_one_chat_is_one_trace_across_gateway_encoder_redis_llm_and_engine(
    traced_stack: ProcessStack, collector: tuple[Collector, int]
) -> None:
    # The caller's own span (a client of the gateway): the trace starts there and crosses HTTP.
    caller = TracerProvider().get_tracer("test").start_span("client", kind=SpanKind.CLIENT)
    headers: dict[str, str] = {}
    propagate.inject(headers, context=trace.set_span_in_context(caller))
    image = data_url(png_bytes(9101))
    body = {"model": "ft-a", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]}]}  # fmt: skip
    response = httpx.post(f"{traced_stack.base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    caller.end()
    assert response.status_code == 200, response.text
    key = httpx.post(f"{traced_stack.base_url}/v1/images/encode", json={"image_url": image}, timeout=60).json()["key"]
    trace_id = caller.get_span_context().trace_id
    wanted = {"POST /v1/chat/completions", "encoder.v1.EncoderService/Encode", "redis GETEX", "redis SET",
              "llm.v1.LLMService/Generate", "redis GET", "engine generate"}  # fmt: skip

    def ours() -> list[ReadableSpan]:
        return [s for s in collector[0].exporter.get_finished_spans() if s.context.trace_id == trace_id]

    deadline = time.monotonic() + 30  # the services export every 100 ms (OTEL_BSP_SCHEDULE_DELAY)
    while {s.name for s in ours()} < wanted and time.monotonic() < deadline:
        time.sleep(0.2)
    spans = ours()
    tree = _tree(spans)
    print(f"\nthe trace of one chat completion:\n{tree}")
    assert {s.name for s in spans} == wanted, tree

    def one(name: str) -> ReadableSpan:
        (span,) = [s for s in spans if s.name == name]
        return span

    def parent_of(name: str) -> ReadableSpan:
        span = one(name)
        assert span.parent is not None, name
        (parent,) = [s for s in spans if s.context.span_id == span.parent.span_id]
        return parent

    gateway, encode, generate = one("POST /v1/chat/completions"), one("encoder.v1.EncoderService/Encode"), one("llm.v1.LLMService/Generate")  # fmt: skip
    assert gateway.parent is not None and gateway.parent.span_id == caller.get_span_context().span_id
    assert {s.resource.attributes["service.name"] for s in spans} == {"gateway", "encoder", "llm"}
    assert (gateway.kind, encode.kind, generate.kind) == (SpanKind.SERVER,) * 3
    assert (
        parent_of("encoder.v1.EncoderService/Encode") is gateway and parent_of("llm.v1.LLMService/Generate") is gateway
    )
    for name in ("redis GETEX", "redis SET"):
        assert parent_of(name) is encode, tree
    for name in ("redis GET", "engine generate"):
        assert parent_of(name) is generate, tree
    # The image key and the model, where each process learns them.
    assert encode.attributes[tracing.MEDIA_KEY] == key
    assert one("redis SET").attributes[tracing.MEDIA_KEYS] == (key,)
    assert generate.attributes[tracing.MODEL] == "ft-a" and generate.attributes[tracing.MEDIA_KEYS] == (key,)
    assert gateway.attributes[tracing.MODEL] == "ft-a" and gateway.attributes[tracing.MEDIA_KEYS] == (key,)
    assert gateway.attributes["http.response.status_code"] == 200
    assert generate.attributes["rpc.grpc.status_code"] == 0
    assert one("engine generate").attributes["vlm.completion_tokens"] == response.json()["usage"]["completion_tokens"]
    # Children within their parents' time.
    for child, parent in [(encode, gateway), (generate, gateway), (one("engine generate"), generate)]:
        assert parent.start_time <= child.start_time and child.end_time <= parent.end_time, (child.name, tree)


def test_tracing_is_off_unless_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert tracing.init_tracing("test", tracing.TracingSettings()) is None
    assert not tracing.enabled() and tracing.client_interceptors() == ()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert tracing.TracingSettings().otlp_endpoint == "http://collector:4317"
