"""`trace_context` against OpenTelemetry's API and W3C propagator: the same current span, the
same headers written, the same context read from any carrier (through `tracing`, which reads
what `parse` leaves to the propagator)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared import trace_context, tracing
from shared.lean_tracer import LeanTracerProvider

W3C = TraceContextTextMapPropagator()
TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"

CARRIERS = [
    {},
    {"traceparent": f"00-{TRACE}-{SPAN}-01"},
    {"traceparent": f"00-{TRACE}-{SPAN}-00"},
    {"traceparent": f"00-{TRACE}-{SPAN}-03"},
    {"traceparent": f"00-{TRACE}-{SPAN}-01", "tracestate": "vendor=v1,other=x"},
    {"traceparent": f"00-{TRACE}-{SPAN}-01", "nats-msg-id": "m-1"},
    {"traceparent": f"00-{TRACE.upper()}-{SPAN}-01"},
    {"traceparent": f" 00-{TRACE}-{SPAN}-01"},
    {"traceparent": f"00-{TRACE}-{SPAN}-01 "},
    {"traceparent": f"00-{TRACE}-{SPAN}-01-extra"},
    {"traceparent": f"01-{TRACE}-{SPAN}-01-future"},
    {"traceparent": f"ff-{TRACE}-{SPAN}-01"},
    {"traceparent": f"00-{'0' * 32}-{SPAN}-01"},
    {"traceparent": f"00-{TRACE}-{'0' * 16}-01"},
    {"traceparent": f"00-{TRACE[:-1]}g-{SPAN}-01"},
    {"traceparent": f"00-{TRACE[:-1]}_-{SPAN}-01"},
    {"traceparent": f"00-{TRACE}-{SPAN}"},
    {"traceparent": ""},
    {"tracestate": "vendor=v1"},
]


def _span_context(ctx: Context | None) -> SpanContext:
    return trace.get_current_span(ctx).get_span_context()


@pytest.fixture
def w3c_tracing() -> Iterator[None]:
    """Tracing on, with W3C trace context alone as the process's propagator."""
    default = propagate.get_global_textmap()
    propagate.set_global_textmap(TraceContextTextMapPropagator())
    provider = LeanTracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    tracing.install(provider)
    yield
    tracing.uninstall()
    propagate.set_global_textmap(default)


@pytest.mark.parametrize("carrier", CARRIERS)
def test_a_carrier_reads_as_the_propagator_reads_it(carrier: dict[str, str],
                                                    w3c_tracing: None) -> None:
    expected = W3C.extract(carrier)
    parsed = trace_context.parse(carrier)
    if parsed is not None:  # read here: the same context, to the field
        assert dict(parsed).keys() == dict(expected).keys()
        assert _span_context(parsed) == _span_context(expected)
    read = tracing.extract(carrier)
    if carrier:
        assert read is not None and _span_context(read) == _span_context(expected)
        assert _span_context(read).trace_state == _span_context(expected).trace_state


def test_only_the_canonical_form_is_read_here() -> None:
    assert trace_context.parse(CARRIERS[1]) is not None
    assert trace_context.parse({}) == Context()
    assert all(trace_context.parse(c) is None for c in CARRIERS[4:5] + CARRIERS[6:])


@pytest.mark.parametrize("span_context", [
    SpanContext(int(TRACE, 16), int(SPAN, 16), False, TraceFlags(TraceFlags.SAMPLED)),
    SpanContext(1, 1, False, TraceFlags(0x03)),
    SpanContext(2**128 - 1, 2**64 - 1, True, TraceFlags(TraceFlags.SAMPLED),
                TraceState([("vendor", "v1"), ("other", "x")])),
])
def test_headers_are_what_the_propagator_writes(span_context: SpanContext,
                                                w3c_tracing: None) -> None:
    carrier: dict[str, str] = {}
    W3C.inject(carrier, trace.set_span_in_context(NonRecordingSpan(span_context)))
    assert trace_context.headers(span_context) == carrier
    with tracing.attached(trace.set_span_in_context(NonRecordingSpan(span_context))):
        assert tracing.inject() == carrier


def test_a_written_header_reads_back_to_its_context(w3c_tracing: None) -> None:
    span_context = SpanContext(int(TRACE, 16), int(SPAN, 16), False,
                               TraceFlags(TraceFlags.SAMPLED))
    read = tracing.extract(trace_context.headers(span_context))
    assert read is not None
    assert _span_context(read) == SpanContext(int(TRACE, 16), int(SPAN, 16), True,
                                              TraceFlags(TraceFlags.SAMPLED))


def test_the_current_span_is_the_apis(w3c_tracing: None) -> None:
    assert trace_context.current_span() is trace.get_current_span() is trace.INVALID_SPAN
    with tracing.span("test", "outer") as outer:
        assert trace_context.current_span() is trace.get_current_span() is outer
        other = trace.set_span_in_context(NonRecordingSpan(SpanContext(7, 8, True)))
        assert trace_context.current_span(other) is trace.get_current_span(other)
        assert trace_context.current_span(Context()) is trace.INVALID_SPAN
        made = trace_context.with_span(outer)
        assert dict(made) == dict(trace.set_span_in_context(outer))
    token = otel_context.attach(otel_context.set_value("other-key", 1))
    try:
        assert trace_context.current_span() is trace.INVALID_SPAN
    finally:
        otel_context.detach(token)
