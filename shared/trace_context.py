"""The current span, and W3C trace context (`traceparent`, `tracestate`) to and from message
headers, in few Python calls.

Why: at 100 % sampling each service looks up the current span a few times a request, and
every message that hands a traced request on passes `tracing.inject` on one side and
`tracing.extract` on the other. Through OpenTelemetry's API these take 8-20 Python calls
each (the context module's layers and an ABC instance check per lookup; the propagator's
getter, setter and regular-expression search), and in a serving process each call runs cold
(the process slept between requests, other processes had the core): with every tracing call
of the four services timed in `bench.tracing_overhead --live`, they were ~85 us of a
request's main-thread CPU in each service, nearly all that tracing added there. Here a
lookup is two calls and a header is written or read in about five.

`parse` reads one form of header, the canonical one (version 00, lowercase hex, no
`tracestate`) that halfmoon's services send, and returns None for every other carrier, so
that the propagator decides those: what any carrier parses to is the propagator's answer
(tests compare the two on valid, invalid and unusual headers). `tracing` uses `headers`
and `parse` only while the process's propagator is W3C trace context alone, as
`configure_tracing` sets it unless `OTEL_PROPAGATORS` names others.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, NonRecordingSpan, SpanContext, TraceFlags

# The key the API keeps the current span under (`trace.set_span_in_context`'s): private to
# OpenTelemetry, so a test checks `current_span` against `trace.get_current_span`.
from opentelemetry.trace.propagation import _SPAN_KEY

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_CANONICAL = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_ROOT = Context()  # what the propagator extracts from a carrier without `traceparent`


def current_span(context: Context | None = None) -> trace.Span:
    """`trace.get_current_span(context)`: `context`'s span (else the current context's),
    or `INVALID_SPAN` when it has none."""
    span = (otel_context.get_current() if context is None else context).get(_SPAN_KEY)
    return INVALID_SPAN if span is None else span  # type: ignore[return-value]


def with_span(span: trace.Span) -> Context:
    """`trace.set_span_in_context(span)`: the current context with `span` as its span."""
    return Context({**otel_context.get_current(), _SPAN_KEY: span})


def headers(span_context: SpanContext) -> dict[str, str]:
    """The headers `TraceContextTextMapPropagator.inject` writes for a valid context."""
    # The API's `SpanContext` is a tuple: unpacked, its fields cost no property call each.
    trace_id, span_id, _remote, flags, trace_state, _valid = span_context
    out = {TRACEPARENT: f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"}
    if trace_state:
        out[TRACESTATE] = trace_state.to_header()
    return out


def parse(carrier: Mapping[str, str]) -> Context | None:
    """The context `TraceContextTextMapPropagator.extract(carrier)` returns, for a carrier
    with a canonical `traceparent` and no `tracestate`, or with neither; None for any
    other carrier (the propagator's to read)."""
    if TRACESTATE in carrier:
        return None
    value = carrier.get(TRACEPARENT)
    if value is None:
        return _ROOT
    if _CANONICAL.fullmatch(value) is None:
        return None
    trace_id, span_id = int(value[3:35], 16), int(value[36:52], 16)
    if not (trace_id and span_id):
        return None
    span_context = SpanContext(trace_id, span_id, is_remote=True,
                               trace_flags=TraceFlags(int(value[53:], 16)))
    return Context({_SPAN_KEY: NonRecordingSpan(span_context)})
