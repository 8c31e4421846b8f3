"""OpenTelemetry tracing: process set-up, context over NATS and the transfer engine, spans.

One trace per request: the gateway's span is its root (or, for a client that sent W3C trace
context, a child of the client's span: `client_context`); its context rides in the headers of
the NATS messages that hand the request on (into the request stream, each command to a
worker, the KV commit; W3C `traceparent`, through OpenTelemetry's global propagator, never
hand-built; trace context alone unless `OTEL_PROPAGATORS` says more), never in a reply, so
each service's spans join it. The header blocks are a part of what tracing costs a request.
Only a sampled request carries context (`inject`), and past the gateway a request's spans
are made only under a sampled context that arrived with it (`continued_span`, `is_traced`),
never as roots of their own: at a sampling ratio below 1 the requests not sampled cost no
header block and no span anywhere, and leave no stray fragments of traces. (A peer from
before this rule sends flags 00 instead: the same decision, at the old cost.)

Set-up, once per process (`configure_tracing`), from the service config, which falls back to
the standard `OTEL_*` variables:
    tracing               auto | off | otlp-grpc | otlp-http   (auto: on when
                          OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT is set, protocol from
                          OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL; off when OTEL_SDK_DISABLED or
                          OTEL_TRACES_EXPORTER=none)
    otlp_endpoint         else OTEL_EXPORTER_OTLP[_TRACES]_ENDPOINT
    trace_sample_ratio    else OTEL_TRACES_SAMPLER(_ARG); parent-based, so a trace is kept or
                          dropped whole
    tracer                lean (`lean_tracer`'s spans) | sdk (the SDK's own span objects: a
                          fallback, 3-11 % less throughput at 100 % sampling here)
Spans are made by `lean_tracer` (the API's spans in a few lines, fed to the SDK's processors
and exporters) unless `tracer` is sdk, and exported with `span_encoding`. With tracing off
nothing is created: `span()` returns a shared no-op context manager and `inject()` returns
None (no headers), so the cost is one attribute read per call site.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shared import span_encoding
from shared.errors import ConfigError
from shared.lean_tracer import LeanTracer, LeanTracerProvider
from shared.logs import get_logger

log = get_logger(__name__)

# Export batches of at most 512 spans, at least every half second (unless the OTEL_BSP_*
# variables say otherwise). Measured with `bench.tracing_overhead --live` at 100 %
# sampling: batches of 2048 (exported every 3-5 s here) cost 7.4-8.1 % of throughput and
# 390-420 us of CPU per request, every service's own work slower (spans kept waiting are
# memory each process walks past); 256-512 spans within 0.5-1 s, 3.4-6.7 % and 150-320 us;
# 64 every 0.1 s, 11.9 % (each export is a gRPC call, and its encoding holds the GIL).
EXPORT_BATCH_SPANS = 512
EXPORT_DELAY_MS = 500
EXPORT_QUEUE_SPANS = 16384  # then spans are dropped (a collector down or too slow)
# What a stopping process gives its last spans before it gives up on the collector.
SHUTDOWN_FLUSH_S = 3.0

_provider: TracerProvider | None = None
_exporter: SpanExporter | None = None  # the one `configure_tracing` made, if it made one
_tracers: dict[str, trace.Tracer] = {}  # by scope: the SDK builds a new one per call
_NO_SPAN = contextlib.nullcontext()


def is_enabled() -> bool:
    return _provider is not None


def install(provider: TracerProvider) -> None:
    """Trace through `provider` from now on (tests install one with an in-memory exporter)."""
    global _provider
    _provider = provider
    _tracers.clear()


def uninstall() -> None:
    global _provider
    _provider = None
    _tracers.clear()


def shutdown(flush_s: float = SHUTDOWN_FLUSH_S) -> None:
    """Flush and stop the exporter (at process exit), within about `flush_s`: with its
    collector unreachable the OTLP exporter retries each batch for up to 10 s, and the
    SDK's shutdown waits up to 30 s for them, which held a stopping service (and
    `halfmoon up`'s Ctrl-C, group after group) that long; after `flush_s` the exporter is
    shut down, which ends its retries, and the spans still queued are dropped."""
    global _exporter
    if _provider is not None:
        give_up = threading.Timer(flush_s, _abandon, (_exporter,))
        give_up.daemon = True
        give_up.start()
        try:
            _provider.shutdown()
        finally:
            give_up.cancel()
    _exporter = None
    uninstall()


def _abandon(exporter: SpanExporter | None) -> None:
    if exporter is None:  # a processor of the caller's (tests): nothing of ours to stop
        return
    log.warning("tracing.flush_abandoned", reason="the collector did not take the last spans "
                "in time; the rest are dropped")
    exporter.shutdown()


def tracer(scope: str) -> trace.Tracer:
    if _provider is None:
        return trace.NoOpTracer()
    found = _tracers.get(scope)
    if found is None:
        found = _tracers[scope] = _provider.get_tracer(scope)
    return found


def span(scope: str, name: str, parent: otel_context.Context | None = None,
         **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
    """A span on `scope`'s tracer, current for the block, a child of `parent` (a context
    from `extract`) or else of the current span; a no-op (yielding None) when off. Like
    `start_as_current_span`, an exception leaving the block is recorded on the span and sets
    its status to error; without its two layers of generator-based context managers (every
    span of every request passes here). A cancellation is no failure of the span's work (it
    was told to stop: an abort, the client gone, a shutdown): a `cancelled` event, status
    left unset."""
    if _provider is None:
        return _NO_SPAN
    return _CurrentSpan(tracer(scope).start_span(name, context=parent, **kwargs))


class _CurrentSpan:
    __slots__ = ("_span", "_token")

    def __init__(self, span: trace.Span) -> None:
        self._span = span
        self._token: object = None

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if exc is not None and self._span.is_recording():
                if isinstance(exc, asyncio.CancelledError):
                    self._span.add_event("cancelled")
                else:
                    failed(self._span, exc)
        finally:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._span.end()


def failed(span: trace.Span | None, exc: BaseException) -> None:
    """Record `exc` on the span and set its status to error, as `span` does for an
    exception leaving its block; nothing when None."""
    if span is not None:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))


def within(span: trace.Span | None) -> contextlib.AbstractContextManager[Any]:
    """Make a span from `continued` current for the block without ending it (its owner
    ends it when the work it describes is done, which may span several blocks); nothing
    when None."""
    return _NO_SPAN if span is None else _Attached(trace.set_span_in_context(span))


def is_traced(ctx: otel_context.Context | None = None) -> bool:
    """Whether `ctx`'s span (else the current one) belongs to a sampled trace."""
    return _provider is not None and \
        trace.get_current_span(ctx).get_span_context().trace_flags.sampled


def recording_span() -> trace.Span | None:
    """The current span if it records (a sampled request's), else None: for code that
    describes its work on the span it runs under. One attribute read when tracing is off."""
    if _provider is None:
        return None
    current = trace.get_current_span()
    return current if current.is_recording() else None


def continued_span(scope: str, name: str, parent: otel_context.Context | None = None,
                   **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
    """`span`, for a request handed on by another service: made only under a sampled
    trace (`parent`'s, else the current one), never a root; else a no-op."""
    started = continued(scope, name, parent, **kwargs)
    return _NO_SPAN if started is None else _CurrentSpan(started)


def continued(scope: str, name: str, parent: otel_context.Context | None = None,
              **kwargs: Any) -> trace.Span | None:
    """`continued_span`'s span, started but not made current (the caller ends it), or
    None: a child only of a sampled trace."""
    if _provider is None:
        return None
    under = trace.get_current_span(parent).get_span_context()
    if not under.trace_flags.sampled:
        return None
    chosen = tracer(scope)
    if isinstance(chosen, LeanTracer):  # the span under `parent` looked up once, not twice
        return chosen.start_child(name, under, parent, **kwargs)
    return chosen.start_span(name, context=parent, **kwargs)


def inject() -> dict[str, str] | None:
    """Headers carrying the current trace context; None when tracing is off or the
    current trace is not sampled (the receivers then make no span for it)."""
    if not is_traced():
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier or None


def extract(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The trace context carried by `headers`, or None (tracing off, or none carried)."""
    if _provider is None or not headers:
        return None
    return propagate.extract(headers)


def client_context(headers: Mapping[str, str]) -> otel_context.Context | None:
    """The trace context an HTTP client sent (`traceparent`, or whatever the global
    propagator reads), or None: tracing off, or none of the propagator's headers sent (a
    lookup per header name, not a parse). A malformed one is ignored: the trace starts here."""
    if _provider is None:
        return None
    propagator = propagate.get_global_textmap()
    if not any(name in headers for name in propagator.fields):
        return None
    return propagator.extract(headers)


def unix_ns(perf_counter_s: float) -> int:
    """A `time.perf_counter()` reading as Unix nanoseconds, the clock spans are stamped in."""
    return time.time_ns() - int((time.perf_counter() - perf_counter_s) * 1e9)


def record_span(scope: str, name: str, start: float, end: float,
                attributes: Mapping[str, Any] | None = None) -> None:
    """A finished child span of the current one, for work timed elsewhere: `start` and `end`
    are `time.perf_counter()` readings."""
    if _provider is None:
        return
    span = tracer(scope).start_span(name, start_time=unix_ns(start), attributes=attributes)
    span.end(end_time=unix_ns(end))


def attached(ctx: otel_context.Context | None) -> contextlib.AbstractContextManager[Any]:
    """Make `ctx` current for the block; nothing when None (every NATS message passes here)."""
    return _NO_SPAN if ctx is None else _Attached(ctx)


class _Attached:
    """`attached`'s context manager: a class, as `_CurrentSpan`, not a generator's layers."""

    __slots__ = ("_context", "_token")

    def __init__(self, ctx: otel_context.Context) -> None:
        self._context = ctx
        self._token: object = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(self._context)

    def __exit__(self, *exc: object) -> None:
        otel_context.detach(self._token)  # type: ignore[arg-type]


def configure_tracing(service_name: str, instance_id: str, *, mode: str,
                      endpoint: str | None, sample_ratio: float | None,
                      env: Mapping[str, str] = os.environ,
                      processor: SpanProcessor | None = None, tracer: str = "lean") -> bool:
    """Set tracing up for this process; return whether it is on."""
    protocol = _protocol(mode, env)
    if protocol is None:
        return False
    ratio = sample_ratio if sample_ratio is not None else _env_ratio(env)
    resource = Resource.create({
        "service.name": env.get("OTEL_SERVICE_NAME") or f"halfmoon-{service_name}",
        "service.namespace": "halfmoon", "service.instance.id": instance_id})
    root = ALWAYS_ON if ratio >= 1.0 else TraceIdRatioBased(ratio)  # the cheaper, at 100 %
    if tracer not in ("lean", "sdk"):
        raise ConfigError(f"tracer must be lean or sdk, not {tracer!r}")
    provider_type = LeanTracerProvider if tracer == "lean" else TracerProvider
    provider = provider_type(resource=resource, sampler=ParentBased(root))
    global _exporter
    _exporter = None
    if processor is None:
        _exporter = _new_exporter(protocol, endpoint)
        processor = BatchSpanProcessor(
            _exporter,
            max_queue_size=None if "OTEL_BSP_MAX_QUEUE_SIZE" in env else EXPORT_QUEUE_SPANS,
            max_export_batch_size=None if "OTEL_BSP_MAX_EXPORT_BATCH_SIZE" in env
            else EXPORT_BATCH_SPANS,
            schedule_delay_millis=None if "OTEL_BSP_SCHEDULE_DELAY" in env
            else EXPORT_DELAY_MS)
    provider.add_span_processor(processor)
    install(provider)
    _choose_propagator(env)
    return True


def _choose_propagator(env: Mapping[str, str]) -> None:
    """W3C trace context alone, unless `OTEL_PROPAGATORS` names the propagators: the default
    adds W3C baggage, which nothing in halfmoon sets (the gateway's span is each trace's
    root), and its inject and extract ran on every traced message for nothing."""
    if "OTEL_PROPAGATORS" not in env:
        propagate.set_global_textmap(TraceContextTextMapPropagator())


def _protocol(mode: str, env: Mapping[str, str]) -> str | None:
    """"grpc", "http/protobuf", or None for off."""
    match mode:
        case "off":
            return None
        case "otlp-grpc":
            return "grpc"
        case "otlp-http":
            return "http/protobuf"
        case "auto":
            if env.get("OTEL_SDK_DISABLED", "").lower() == "true" or \
                    env.get("OTEL_TRACES_EXPORTER", "otlp") == "none":
                return None
            if not (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                    or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
                return None
            protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
            if protocol not in ("grpc", "http/protobuf"):
                raise ConfigError(f"unsupported OTLP protocol {protocol!r}: grpc or "
                                  "http/protobuf")
            return protocol
    raise ConfigError(f"tracing must be auto, off, otlp-grpc or otlp-http, not {mode!r}")


def _env_ratio(env: Mapping[str, str]) -> float:
    sampler = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    if sampler.endswith("always_off"):
        return 0.0
    if sampler.endswith("traceidratio"):
        try:
            return float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError as exc:
            raise ConfigError(f"OTEL_TRACES_SAMPLER_ARG must be a number: {exc}") from exc
    return 1.0


def _new_exporter(protocol: str, endpoint: str | None) -> SpanExporter:
    # The exporters read OTEL_EXPORTER_OTLP_* themselves when `endpoint` is None.
    if protocol == "grpc":
        return _grpc_exporter(endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    if endpoint is not None and not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"  # the signal path, as the env var adds
    return HttpSpanExporter(endpoint=endpoint)


def _grpc_exporter(endpoint: str | None) -> Any:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    class GrpcSpanExporter(OTLPSpanExporter):  # type: ignore[misc]
        """The SDK's OTLP/gRPC exporter (retries, TLS, headers, compression) with spans
        encoded by `span_encoding`: the same message, built several times faster. (An SDK
        without this hook keeps its own encoder: slower, equally correct.)"""

        def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
            return ExportTraceServiceRequest.FromString(span_encoding.encode_spans(data))

    return GrpcSpanExporter(endpoint=endpoint)
