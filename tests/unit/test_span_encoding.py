"""halfmoon's OTLP span encoder against the SDK's own, and the span scope of `tracing`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
)

from shared import tracing
from shared.span_encoding import encode_spans

REMOTE_PARENT = SpanContext(trace_id=0x0123456789ABCDEF0123456789ABCDEF,
                            span_id=0x1122334455667788, is_remote=True,
                            trace_flags=TraceFlags(TraceFlags.SAMPLED),
                            trace_state=TraceState([("vendor", "v1"), ("other", "x")]))


def _provider(resource: Resource, exporter: InMemorySpanExporter,
              limits: SpanLimits | None = None) -> TracerProvider:
    provider = TracerProvider(resource=resource, span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _varied_spans() -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    gateway = _provider(Resource.create({"service.name": "gateway", "n": 3}), exporter)
    worker = _provider(Resource.create({"service.name": "prefill"}, schema_url="https://s/1"),
                       exporter, SpanLimits(max_span_attributes=4, max_events=2, max_links=1))
    tracer = gateway.get_tracer("gateway", "1.2.3", schema_url="https://scope/1")
    with tracer.start_as_current_span("gateway.request", kind=SpanKind.SERVER, attributes={
            "s": "text", "empty": "", "t": True, "f": False, "zero": 0, "small": 7,
            "big": 2**40, "negative": -5, "min": -(2**63), "pi": 3.25, "nothing": 0.0,
            "strings": ("a", ""), "ints": (1, -1, 300), "floats": (0.5,), "bools": (True,),
            "bytes": b"\x00\xff", "unicode": "ünï ✓"}) as root:
        root.add_event("first_token", {"halfmoon.cached_tokens": 0})
        root.add_event("")
        root.set_status(Status(StatusCode.ERROR, "boom"))
        with tracer.start_as_current_span("inner", kind=SpanKind.CLIENT) as inner:
            inner.set_status(Status(StatusCode.OK))
        tracer.start_span("unscoped-consumer", kind=SpanKind.CONSUMER).end()
    remote = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    other = worker.get_tracer("prefill")
    span = other.start_span("prefill.request", context=remote, kind=SpanKind.PRODUCER,
                            links=[Link(REMOTE_PARENT, {"why": "retry"}),
                                   Link(REMOTE_PARENT)],
                            attributes={f"a{i}": i for i in range(6)})  # 2 dropped
    for i in range(3):  # one dropped
        span.add_event("layer", {"layer": i}, timestamp=1_700_000_000_000_000_000 + i)
    span.end()
    return list(exporter.get_finished_spans())


def test_the_encoding_parses_to_the_sdk_encoders_message() -> None:
    spans = _varied_spans()
    assert ExportTraceServiceRequest.FromString(encode_spans(spans)) == sdk_encode(spans)


def test_dropped_counts_links_remote_parents_and_trace_state_are_kept() -> None:
    spans = _varied_spans()
    request = ExportTraceServiceRequest.FromString(encode_spans(spans))
    (worker_spans,) = [r for r in request.resource_spans if r.schema_url == "https://s/1"]
    (span,) = worker_spans.scope_spans[0].spans
    assert (span.dropped_attributes_count, span.dropped_events_count,
            span.dropped_links_count) == (2, 1, 1)
    assert span.parent_span_id == REMOTE_PARENT.span_id.to_bytes(8, "big")
    assert span.flags == 0x300  # the parent's remoteness is known, and it is remote
    assert span.trace_state == "vendor=v1,other=x"


def test_an_empty_batch_is_an_empty_request() -> None:
    assert encode_spans([]) == b""
    assert ExportTraceServiceRequest.FromString(b"") == sdk_encode([])


def test_the_grpc_exporter_sends_the_encoders_message() -> None:
    spans = _varied_spans()
    exporter = tracing._grpc_exporter("http://127.0.0.1:9")  # nothing is sent
    try:
        assert exporter._translate_data(spans) == sdk_encode(spans)
    finally:
        exporter.shutdown()


@pytest.fixture
def recorded() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(_provider(Resource.create({}), exporter))
    yield exporter
    tracing.uninstall()


def test_a_span_is_current_in_its_block_and_a_child_of_the_given_parent(
        recorded: InMemorySpanExporter) -> None:
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    with tracing.span("test", "outer", parent=parent) as outer:
        assert trace.get_current_span() is outer
        with tracing.span("test", "inner"):
            pass
    assert trace.get_current_span() is not outer
    inner, finished = recorded.get_finished_spans()
    assert finished.parent == REMOTE_PARENT
    assert inner.parent is not None and inner.parent.span_id == finished.context.span_id


def test_an_exception_leaving_a_span_is_recorded_as_its_error(
        recorded: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError, match="bad"), tracing.span("test", "failing"):
        raise ValueError("bad")
    (span,) = recorded.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ValueError: bad"
    assert [e.name for e in span.events] == ["exception"]
