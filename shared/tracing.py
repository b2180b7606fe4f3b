"""OpenTelemetry traces of a request across the services: the gateway's HTTP request, the
encoder's Encode, Redis round trips, the LLM service's Generate and its engine run, one trace.

Off unless `OTEL_EXPORTER_OTLP_ENDPOINT` names an OTLP/gRPC collector (http://collector:4317):
spans then go there in batches, from a background thread. Off, every span below is the API's
non-recording one (no export, no allocation of note), and no interceptor is installed on clients.

The trace crosses processes as W3C `traceparent` (and `tracestate`) gRPC metadata: clients inject
the context current at the call (client_interceptors), servers continue it
(TracingInterceptor), so each server span is the child of the caller's span.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.grpc_metrics import call_labels, status_name
from shared.grpc_wrap import within

TRACER = trace.get_tracer("vlm_encode_once")
# Attribute names of ours, beside OpenTelemetry's semantic conventions (rpc.*, db.*, http.*).
MODEL = "vlm.model"
MEDIA_KEY = "vlm.media.key"  # one image or video's storage key
MEDIA_KEYS = "vlm.media.keys"  # every key a request uses, in order


class TracingSettings(BaseSettings):
    """OpenTelemetry's own environment variable, as every OpenTelemetry SDK reads it: the same in
    every service, so not under a service's prefix."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True)

    otlp_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("OTEL_EXPORTER_OTLP_ENDPOINT", "otlp_endpoint"),
        description="OTLP/gRPC collector for traces (http://host:4317: plaintext; https: TLS); unset = off.",
    )


def init_tracing(service: str, settings: TracingSettings) -> TracerProvider | None:
    """Called once, in each service's __main__: exports this process's spans as `service` when an
    endpoint is set; returns the provider to shut down (flushing what is left) at exit."""
    if not settings.otlp_endpoint:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    trace.set_tracer_provider(provider)
    return provider


def enabled() -> bool:
    """Whether spans are recorded in this process (a provider was installed)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def annotate(attributes: dict[str, Any]) -> None:
    """Sets attributes on the span in force (the RPC's, the request's); nothing when off."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes(attributes)


@contextmanager
def step_span(name: str, attributes: dict[str, Any], kind: SpanKind = SpanKind.INTERNAL) -> Iterator[Span]:
    """A span around one step of the call in force (a Redis round trip, the engine's run), its
    child. Not made current, so it may be held across an async generator's yields. Only where the
    step belongs to a traced call: readiness pings and the like make no trace of their own."""
    parent = trace.get_current_span()
    if not parent.is_recording():
        yield parent
        return
    span = TRACER.start_span(name, kind=kind, attributes=attributes)
    try:
        yield span
    except BaseException as error:
        span.set_status(Status(StatusCode.ERROR, type(error).__name__))
        raise
    finally:
        span.end()


@contextmanager
def http_server_span(method: str, path: str, headers: Mapping[str, str], record: bool = True) -> Iterator[Span]:
    """The SERVER span of one HTTP request, current for the block: the child of the caller's span
    when it sent `traceparent`. Not recorded when off, or when `record` is false (probes)."""
    if not (record and enabled()):
        yield trace.INVALID_SPAN
        return
    with TRACER.start_as_current_span(
        f"{method} {path}",
        context=propagate.extract(headers),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path},
        record_exception=False,  # the status says what went wrong; the gateway logs the rest
        set_status_on_exception=False,
    ) as span:
        yield span


def end_http_span(span: Span, method: str, route: str, status: int, attributes: dict[str, Any]) -> None:
    """Names the span by its route (low cardinality, as OpenTelemetry asks) and records the outcome."""
    if not span.is_recording():
        return
    span.update_name(f"{method} {route}")
    span.set_attributes({"http.route": route, "http.response.status_code": status, **attributes})
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))


def _server_span(method: str, labels: tuple[str, str, str], context: grpc.aio.ServicerContext) -> Any:
    carrier = {key: value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
    service, _, _ = labels
    return TRACER.start_as_current_span(
        method.lstrip("/"),
        context=propagate.extract(carrier),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method.rpartition("/")[2]},
        record_exception=False,  # the status code says what went wrong; the error interceptor logs the rest
        set_status_on_exception=False,
    )


def _end(span: Span, context: grpc.aio.ServicerContext, error: BaseException | None) -> None:
    code = status_name(context, error)
    span.set_attribute("rpc.grpc.status_code", getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN).value[0])
    if code != "OK":
        span.set_status(Status(StatusCode.ERROR, code))


@contextmanager
def _traced_call(method: str, labels: tuple[str, str, str], context: grpc.aio.ServicerContext) -> Iterator[None]:
    with _server_span(method, labels, context) as span:
        error: BaseException | None = None
        try:
            yield
        except BaseException as raised:
            error = raised
            raise
        finally:
            _end(span, context, error)


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """A SERVER span per call, the child of the caller's span when it sent `traceparent`."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not enabled():
            return handler
        method = handler_call_details.method
        labels = call_labels(method, handler)

        return within(handler, lambda context: _traced_call(method, labels, context))


def trace_context() -> dict[str, str]:
    """The trace context in force, as call metadata (`traceparent`, `tracestate`); empty when none."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    carrier = trace_context()
    if not carrier:
        return details
    metadata = grpc.aio.Metadata(*(details.metadata or ()), *carrier.items())
    return grpc.aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class TraceContextUnaryInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Sends the context in force with every unary call, so the server's span joins the caller's trace."""

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_trace_context(client_call_details), request)


class TraceContextStreamInterceptor(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls. A class of its own: a grpc.aio channel files each
    interceptor under the first kind of call it serves, so one object cannot serve both."""

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_with_trace_context(client_call_details), request)


def client_interceptors() -> tuple[grpc.aio.ClientInterceptor, ...]:
    """What a process's async gRPC clients install (shared.sdk.ChannelConfig.aio_interceptors): the
    propagators when tracing is on, none when off (an interceptor costs every call)."""
    return (TraceContextUnaryInterceptor(), TraceContextStreamInterceptor()) if enabled() else ()


def client_call_metadata() -> Callable[[], dict[str, str]] | None:
    """The same for calls no interceptor sees (shared.sdk.ChannelConfig.call_metadata): the trace
    context when tracing is on, nothing when off."""
    return trace_context if enabled() else None
