"""Spans made with little code: the OpenTelemetry API's `Tracer` and `Span`, recorded into
plain slotted objects that the SDK's span processors and exporters take as they take its own.

Why: at 100 % sampling every request opens about six spans across four processes, and in a
serving process each one runs "cold" (the process slept between requests, other processes
had the cores): the SDK's `start_span`/`end` then cost ~280 us of CPU a span here, ten times
their cost in a tight loop, because they run a lot of distinct code (tracer metrics, sampler
result objects, bounded attribute maps behind locks, a `ReadableSpan` copy at the end). This
tracer does what the spans of this system need in a few lines: ~95 us cold, ~5 us hot.

What stays the SDK's: the `TracerProvider` (resource, sampler, id generator, span processors,
shutdown and flush), so the `BatchSpanProcessor` and the OTLP (gRPC, HTTP) and in-memory
exporters work unchanged (not the console exporter, which calls `to_json`: halfmoon exports
OTLP only; `--tracer sdk` has it); the root sampling decision (the provider's sampler); the
limits (the provider's `SpanLimits`, from the `OTEL_*_LIMIT` variables by default; as in the
SDK, the oldest attribute, event or link gives way to a new one). What differs: a child's
sampling follows its parent's flag (parent-based, as halfmoon's provider is configured: a
trace is kept or dropped whole), and a span is not locked (each is used by one thread at a
time, as every span of this system is).
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType, TracebackType
from typing import Any, NamedTuple

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.util.types import Attributes, AttributeValue

log = logging.getLogger(__name__)

_SCALARS = (str, bool, int, float)
_UNSET = Status(StatusCode.UNSET)
_RANDOM_TRACE_ID = getattr(TraceFlags, "RANDOM_TRACE_ID", 0)  # W3C level 2; older APIs lack it


class RecordedEvent(NamedTuple):
    """A span event, as exporters read one (`opentelemetry.sdk.trace.Event`'s fields)."""
    name: str
    timestamp: int
    attributes: Mapping[str, AttributeValue]
    dropped_attributes: int = 0


class LeanTracerProvider(TracerProvider):
    """The SDK's provider, whose tracers make `RecordedSpan`s."""

    def get_tracer(self, instrumenting_module_name: str,
                   instrumenting_library_version: str | None = None,
                   schema_url: str | None = None, attributes: Attributes = None
                   ) -> trace.Tracer:
        if self._disabled:  # OTEL_SDK_DISABLED, as the SDK's provider
            return trace.NoOpTracer()
        scope = InstrumentationScope(instrumenting_module_name,
                                     instrumenting_library_version or "", schema_url,
                                     attributes)
        return LeanTracer(self, scope, self._active_span_processor, self._span_limits)


class LeanTracer(trace.Tracer):
    """One instrumentation scope's tracer: samples, makes ids, starts `RecordedSpan`s."""

    def __init__(self, provider: TracerProvider, scope: InstrumentationScope,
                 processor: SpanProcessor, limits: SpanLimits) -> None:
        self._sampler = provider.sampler
        self._new_span_id = provider.id_generator.generate_span_id
        self._new_trace_id = provider.id_generator.generate_trace_id
        self._random_trace_ids = getattr(provider.id_generator, "is_trace_id_random",
                                         lambda: False)()
        # Every root sampled, the sampler adding nothing (parent-based over always-on, as
        # halfmoon's provider is at 100 %): the flags, decided once, without the three
        # lookups of the current span that asking the sampler costs each root.
        every_root = isinstance(self._sampler, ParentBased) and \
            getattr(self._sampler, "_root", None) is ALWAYS_ON
        self._root_flags = TraceFlags(
            TraceFlags.SAMPLED | (_RANDOM_TRACE_ID if self._random_trace_ids else 0)
        ) if every_root else None
        self._processor = processor
        self._limits = limits
        self.resource: Resource = provider.resource
        self.scope = scope

    def start_span(self, name: str, context: otel_context.Context | None = None,
                   kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes = None,
                   links: Sequence[Link] | None = (), start_time: int | None = None,
                   record_exception: bool = True, set_status_on_exception: bool = True,
                   ) -> trace.Span:
        return self.start_child(name, trace.get_current_span(context).get_span_context(),
                                context, kind, attributes, links, start_time)

    def start_child(self, name: str, parent: SpanContext | None,
                    context: otel_context.Context | None = None,
                    kind: SpanKind = SpanKind.INTERNAL, attributes: Attributes = None,
                    links: Sequence[Link] | None = (), start_time: int | None = None,
                    ) -> trace.Span:
        """`start_span` under `parent` (`context`'s span's, already looked up), a root when
        that is None or invalid."""
        if parent is not None and parent.is_valid:
            trace_id, flags = parent.trace_id, parent.trace_flags
            trace_state, recording = parent.trace_state, flags.sampled
        elif self._root_flags is not None:
            parent, trace_id = None, self._new_trace_id()
            flags, trace_state, recording = self._root_flags, None, True
        else:
            parent = None
            trace_id = self._new_trace_id()
            decided = self._sampler.should_sample(context, trace_id, name, kind, attributes,
                                                  links)
            flags = TraceFlags(
                (TraceFlags.SAMPLED if decided.decision.is_sampled() else TraceFlags.DEFAULT)
                | (_RANDOM_TRACE_ID if self._random_trace_ids else 0))
            trace_state, recording = decided.trace_state, decided.decision.is_recording()
            if decided.attributes:
                attributes = {**decided.attributes, **(attributes or {})}
        span_context = SpanContext(trace_id, self._new_span_id(), is_remote=False,
                                   trace_flags=flags, trace_state=trace_state)
        if not recording:  # (a RECORD_ONLY root is recorded; exporters skip it, unsampled)
            return trace.NonRecordingSpan(span_context)
        span = RecordedSpan(self, name, span_context, parent, kind, start_time or time.time_ns())
        if attributes:
            span.set_attributes(attributes)
        for link in links or ():
            span.add_link(link.context, link.attributes)
        self._processor.on_start(span, parent_context=context)  # type: ignore[arg-type]
        return span

    @contextmanager
    def start_as_current_span(self, name: str, context: otel_context.Context | None = None,
                              kind: SpanKind = SpanKind.INTERNAL,
                              attributes: Attributes = None,
                              links: Sequence[Link] | None = (),
                              start_time: int | None = None, record_exception: bool = True,
                              set_status_on_exception: bool = True, end_on_exit: bool = True,
                              ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(span, end_on_exit=end_on_exit,
                            record_exception=record_exception,
                            set_status_on_exception=set_status_on_exception):
            yield span


class RecordedSpan(trace.Span):
    """A sampled span: the API's `Span` for the code that records it, the SDK's
    `ReadableSpan` fields for the processors and exporters that read it once ended."""

    __slots__ = (
        "_attributes",
        "_events",
        "_links",
        "_tracer",
        "context",
        "dropped_attributes",
        "dropped_events",
        "dropped_links",
        "end_time",
        "kind",
        "name",
        "parent",
        "start_time",
        "status",
    )

    def __init__(self, tracer: LeanTracer, name: str, context: SpanContext,
                 parent: SpanContext | None, kind: SpanKind, start_time: int) -> None:
        self._tracer = tracer
        self.name = name
        self.context = context
        self.parent = parent
        self.kind = kind
        self.start_time = start_time
        self.end_time: int | None = None
        self._attributes: dict[str, AttributeValue] = {}
        self._events: list[RecordedEvent] = []
        self._links: list[Link] = []
        self.status = _UNSET
        self.dropped_attributes = self.dropped_events = self.dropped_links = 0

    # What exporters read (`ReadableSpan`'s names).
    @property
    def attributes(self) -> Mapping[str, AttributeValue]:
        return MappingProxyType(self._attributes)

    @property
    def events(self) -> Sequence[RecordedEvent]:
        return tuple(self._events)

    @property
    def links(self) -> Sequence[Link]:
        return tuple(self._links)

    @property
    def resource(self) -> Resource:
        return self._tracer.resource

    @property
    def instrumentation_scope(self) -> InstrumentationScope:
        return self._tracer.scope

    def get_span_context(self) -> SpanContext:
        return self.context

    # What the code that records it calls (the API's `Span`).
    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: AttributeValue) -> None:
        self.set_attributes({key: value})

    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        if self.end_time is not None:
            log.warning("Setting attributes on an ended span %s", self.name)
            return
        self.dropped_attributes += _store(self._attributes, attributes, self._tracer._limits,
                                          self._tracer._limits.max_span_attributes)

    def add_event(self, name: str, attributes: Attributes = None,
                  timestamp: int | None = None) -> None:
        if self.end_time is not None:
            log.warning("Adding an event to an ended span %s", self.name)
            return
        limits = self._tracer._limits
        stored: dict[str, AttributeValue] = {}
        dropped = _store(stored, attributes, limits, limits.max_event_attributes) \
            if attributes else 0
        self.dropped_events += _append(self._events, limits.max_events, RecordedEvent(
            name, timestamp or time.time_ns(), stored, dropped))

    def add_link(self, context: SpanContext, attributes: Attributes = None) -> None:
        if not context.is_valid:
            return
        limits = self._tracer._limits
        stored: dict[str, AttributeValue] = {}
        if attributes:
            _store(stored, attributes, limits, limits.max_link_attributes)
        self.dropped_links += _append(self._links, limits.max_links, Link(context, stored))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None
                   ) -> None:
        """As the SDK's: OK is final, UNSET is ignored."""
        if self.status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self.status = status

    def record_exception(self, exception: BaseException, attributes: Attributes = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        """An `exception` event with the semantic-convention attributes, as the SDK's."""
        kind = type(exception)
        module = kind.__module__
        self.add_event("exception", {
            "exception.type": f"{module}.{kind.__qualname__}"
            if module and module != "builtins" else kind.__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped), **(attributes or {})}, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is not None:
            log.warning("Calling end() on an ended span %s", self.name)
            return
        self.end_time = end_time or time.time_ns()
        self._tracer._processor.on_end(self)  # type: ignore[arg-type]

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback_: TracebackType | None) -> None:
        """`with tracer.start_span(...)`: as the SDK's, an exception is recorded."""
        if exc is not None and self.end_time is None:
            self.record_exception(exc, escaped=True)
            self.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        self.end()

    def __repr__(self) -> str:
        return f"RecordedSpan(name={self.name!r}, context={self.context!r})"


def _store(into: dict[str, AttributeValue], attributes: Mapping[str, Any] | None,
           limits: SpanLimits, max_count: int | None) -> int:
    """Add `attributes` to `into`, keeping at most `max_count` keys (the oldest give way);
    return how many were dropped. Strings, bools, ints and floats go in as they are (cut to
    the length limit, if one is set); anything else is cleaned as the SDK cleans it
    (sequences to tuples, invalid values dropped with a warning)."""
    dropped = 0
    max_length = limits.max_span_attribute_length
    for key, value in (attributes or {}).items():
        if type(value) not in _SCALARS:
            value = BoundedAttributes(attributes={key: value}, immutable=False,
                                      max_value_len=max_length).get(key)
            if value is None:
                dropped += 1
                continue
        elif max_length is not None and type(value) is str:
            value = value[:max_length]
        if key in into:
            del into[key]  # a key set again counts as new (the SDK's order)
        elif max_count is not None and len(into) >= max_count:
            dropped += 1
            if not into:  # a limit of 0
                continue
            del into[next(iter(into))]
        into[key] = value
    return dropped


def _append(items: list[Any], max_count: int | None, item: Any) -> int:
    """Append `item`, the oldest giving way past `max_count`; return how many were dropped."""
    items.append(item)
    if max_count is not None and len(items) > max_count:
        del items[0]
        return 1
    return 0
