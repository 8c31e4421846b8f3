"""halfmoon's OTLP span encoder and lean tracer against the SDK's own, and the span scope of
`tracing`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
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
from shared.errors import ConfigError
from shared.lean_tracer import LeanTracerProvider
from shared.span_encoding import encode_spans

REMOTE_PARENT = SpanContext(trace_id=0x0123456789ABCDEF0123456789ABCDEF,
                            span_id=0x1122334455667788, is_remote=True,
                            trace_flags=TraceFlags(TraceFlags.SAMPLED),
                            trace_state=TraceState([("vendor", "v1"), ("other", "x")]))


class CountingIds(IdGenerator):
    """Ids 1, 2, 3...: two providers given the same calls make the same ids."""

    def __init__(self) -> None:
        self._last = 0

    def generate_span_id(self) -> int:
        self._last += 1
        return self._last

    def generate_trace_id(self) -> int:
        self._last += 1
        return self._last << 64 | self._last


PROVIDERS = [TracerProvider, LeanTracerProvider]


def _provider(resource: Resource, exporter: InMemorySpanExporter,
              limits: SpanLimits | None = None, kind: type[TracerProvider] = TracerProvider,
              ids: IdGenerator | None = None) -> TracerProvider:
    provider = kind(resource=resource, span_limits=limits, id_generator=ids)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def _varied_spans(kind: type[TracerProvider] = TracerProvider) -> list[ReadableSpan]:
    """Spans of every shape (attribute types, events, links, limits, status, kinds, scopes,
    remote parents), made through providers of `kind`, with fixed ids and timestamps."""
    exporter = InMemorySpanExporter()
    ids = CountingIds()
    gateway = _provider(Resource.create({"service.name": "gateway", "n": 3}), exporter,
                        kind=kind, ids=ids)
    worker = _provider(Resource.create({"service.name": "prefill"}, schema_url="https://s/1"),
                       exporter, SpanLimits(max_span_attributes=4, max_events=2, max_links=1),
                       kind=kind, ids=ids)
    at = iter(range(1_700_000_000_000_000_000, 1_800_000_000_000_000_000, 1000))
    tracer = gateway.get_tracer("gateway", "1.2.3", schema_url="https://scope/1")
    root = tracer.start_span("gateway.request", kind=SpanKind.SERVER, start_time=next(at),
                             attributes={
            "s": "text", "empty": "", "t": True, "f": False, "zero": 0, "small": 7,
            "big": 2**40, "negative": -5, "min": -(2**63), "pi": 3.25, "nothing": 0.0,
            "strings": ("a", ""), "ints": (1, -1, 300), "floats": (0.5,), "bools": (True,),
            "bytes": b"\x00\xff", "unicode": "ünï ✓"})
    with trace.use_span(root, end_on_exit=False):
        root.add_event("first_token", {"halfmoon.cached_tokens": 0}, timestamp=next(at))
        root.add_event("", timestamp=next(at))
        root.set_status(Status(StatusCode.ERROR, "boom"))
        inner = tracer.start_span("inner", kind=SpanKind.CLIENT, start_time=next(at))
        inner.set_status(Status(StatusCode.OK))
        inner.set_status(StatusCode.ERROR, "too late: OK is final")
        inner.set_attribute("late", [1, 2])
        inner.update_name("inner.renamed")
        inner.end(end_time=next(at))
        inner.set_attribute("after.end", 1)  # ignored
        tracer.start_span("unscoped-consumer", kind=SpanKind.CONSUMER,
                          start_time=next(at)).end(end_time=next(at))
    root.end(end_time=next(at))
    remote = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    other = worker.get_tracer("prefill")
    span = other.start_span("prefill.request", context=remote, kind=SpanKind.PRODUCER,
                            links=[Link(REMOTE_PARENT, {"why": "retry"}),
                                   Link(REMOTE_PARENT)],
                            attributes={f"a{i}": i for i in range(6)},  # 2 dropped
                            start_time=next(at))
    for i in range(3):  # one dropped
        span.add_event("layer", {"layer": i}, timestamp=next(at))
    span.end(end_time=next(at))
    return list(exporter.get_finished_spans())


def test_the_lean_tracer_exports_what_the_sdk_tracer_exports() -> None:
    lean, sdk = _varied_spans(LeanTracerProvider), _varied_spans(TracerProvider)
    assert {type(s).__name__ for s in lean} == {"RecordedSpan"}
    assert sdk_encode(lean) == sdk_encode(sdk)
    assert ExportTraceServiceRequest.FromString(encode_spans(lean)) == sdk_encode(sdk)


@pytest.mark.parametrize("kind", PROVIDERS)
def test_a_root_is_sampled_by_the_providers_sampler_and_a_child_follows_its_parent(
        kind: type[TracerProvider]) -> None:
    exporter = InMemorySpanExporter()
    provider = kind(sampler=ParentBased(TraceIdRatioBased(0.5)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    kept = 0
    for _ in range(400):
        root = tracer.start_span("root")
        with trace.use_span(root, end_on_exit=True):
            tracer.start_span("child").end()
        kept += root.get_span_context().trace_flags.sampled
        assert root.is_recording() is False
    finished = exporter.get_finished_spans()
    assert len(finished) == 2 * kept and 120 < kept < 280
    unsampled_parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        trace_id=7, span_id=8, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))))
    child = tracer.start_span("child", context=unsampled_parent)
    assert not child.is_recording() and child.get_span_context().trace_id == 7


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


@pytest.fixture(params=PROVIDERS)
def recorded(request: pytest.FixtureRequest) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.install(_provider(Resource.create({}), exporter, kind=request.param))
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


def test_a_continued_span_is_made_only_as_the_child_of_a_sampled_trace(
        recorded: InMemorySpanExporter) -> None:
    with tracing.continued_span("test", "orphan") as orphan:  # nothing current: no root
        assert orphan is None
    unsampled = trace.set_span_in_context(NonRecordingSpan(SpanContext(
        trace_id=7, span_id=8, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))))
    assert tracing.continued("test", "unsampled", parent=unsampled) is None
    parent = trace.set_span_in_context(NonRecordingSpan(REMOTE_PARENT))
    with tracing.continued_span("test", "handed.on", parent=parent,
                                attributes={"halfmoon.request_id": "r-1"}) as span:
        assert trace.get_current_span() is span
        with tracing.attached(parent):  # under what is current, and not made current
            side = tracing.continued("test", "side")
        assert side is not None and trace.get_current_span() is span
        side.end()
    first, second = recorded.get_finished_spans()
    assert (first.name, second.name) == ("side", "handed.on")
    assert first.parent == second.parent == REMOTE_PARENT
    assert first.context.trace_id == REMOTE_PARENT.trace_id
    assert dict(second.attributes or {}) == {"halfmoon.request_id": "r-1"}


def test_an_exception_leaving_a_span_is_recorded_as_its_error(
        recorded: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError, match="bad"), tracing.span("test", "failing"):
        raise ValueError("bad")
    (span,) = recorded.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "ValueError: bad"
    assert [e.name for e in span.events] == ["exception"]


@pytest.fixture
def configured() -> Iterator[None]:
    """`configure_tracing` may be called in the test; what it set is undone after."""
    default = propagate.get_global_textmap()
    yield
    tracing.uninstall()
    propagate.set_global_textmap(default)


def _configure(env: dict[str, str], tracer: str = "lean") -> bool:
    return tracing.configure_tracing("test", "t-1", mode="otlp-grpc", endpoint=None,
                                     sample_ratio=1.0, env=env, tracer=tracer,
                                     processor=SimpleSpanProcessor(InMemorySpanExporter()))


@pytest.mark.parametrize(("env", "headers"), [
    ({}, {"traceparent"}),  # no baggage: nothing in halfmoon sets it
    ({"OTEL_PROPAGATORS": "tracecontext,baggage"}, {"traceparent", "baggage"}),
])
def test_trace_context_alone_is_propagated_unless_otel_propagators_says_more(
        env: dict[str, str], headers: set[str], configured: None) -> None:
    token = otel_context.attach(baggage.set_baggage("tenant", "a"))
    try:
        assert _configure(env)
        with tracing.span("test", "outer"):
            assert set(tracing.inject() or {}) == headers
    finally:
        otel_context.detach(token)


@pytest.mark.parametrize(("tracer", "span_type"), [("lean", "RecordedSpan"), ("sdk", "_Span")])
def test_the_tracer_setting_picks_whose_spans_are_made(tracer: str, span_type: str,
                                                       configured: None) -> None:
    assert _configure({}, tracer)
    with tracing.span("test", "s") as span:
        assert type(span).__name__ == span_type
    with pytest.raises(ConfigError, match="tracer must be lean or sdk"):
        _configure({}, "fast")


def _batch_settings() -> tuple[int, float]:
    """The installed provider's batch processor: (batch size, delay in ms) (SDK internals)."""
    assert tracing._provider is not None
    (processor,) = tracing._provider._active_span_processor._span_processors
    assert isinstance(processor, BatchSpanProcessor)
    batching = processor._batch_processor
    return batching._max_export_batch_size, batching._schedule_delay_millis


@pytest.mark.parametrize(("env", "settings"), [
    ({}, (tracing.EXPORT_BATCH_SPANS, tracing.EXPORT_DELAY_MS)),
    ({"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "100", "OTEL_BSP_SCHEDULE_DELAY": "2000"}, (100, 2000)),
])
def test_spans_are_exported_in_small_batches_unless_otel_bsp_says_otherwise(
        env: dict[str, str], settings: tuple[int, float], configured: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)  # the SDK reads them from the process environment
    assert tracing.configure_tracing("test", "t-1", mode="otlp-grpc",
                                     endpoint="http://127.0.0.1:9", sample_ratio=1.0,
                                     env={**os.environ, **env})
    try:
        assert _batch_settings() == settings
    finally:
        tracing.shutdown()
