"""Where tracing's cost sits: the CPU a request takes with the whole stack in this process.

Every service runs here (`tests.stack.Stack`: fake engine, a real nats-server), so this
process's CPU (`time.process_time`, every thread: the span exporter's too) is the stack's
own, apart from nats-server's. In `--rounds` rounds, tracing off and tracing in one
`--variant` take turns (ABBA), each window `--requests` streamed requests at
`--concurrency` clients. Spans are encoded as the OTLP exporter encodes them, then dropped.
The variants take tracing apart:

    on        every span recorded and encoded
    drop      every span recorded, dropped unencoded
    ratio0    no span recorded (sampler ratio 0), trace context still propagated
    header    a constant `traceparent` header on the same messages, no OpenTelemetry
              inject or extract (no span recorded): the cost of the header blocks alone
    noheader  tracing on, no header sent (non-recording spans only)

Prints the CPU per request of each window and the medians' difference. Steadier than the
process-per-service benchmark (`bench.tracing_overhead`), which the acceptance figure is
measured on; it shows what each part costs, not what a deployment loses.

    python -m bench.tracing_cost --variant on [--rounds 6 --requests 300]

Run from a checkout: the stack is the test suite's (`tests/stack.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
from opentelemetry import propagate
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from bench.control_path import one_request
from shared import span_encoding, tracing
from shared.lean_tracer import LeanTracerProvider
from shared.logs import configure_logging
from shared.nats_server import EmbeddedNatsServer
from tests.stack import Stack

VARIANTS = ("on", "drop", "ratio0", "header", "noheader")
TRACEPARENT = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}


class EncodingExporter(SpanExporter):
    """Encodes each batch as the OTLP exporter does, and sends it nowhere."""

    def __init__(self, encode: bool) -> None:
        self._encode = encode

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._encode:
            span_encoding.encode_spans(spans)
        return SpanExportResult.SUCCESS


def provider_for(variant: str) -> LeanTracerProvider:
    recorded = variant in ("on", "drop")
    provider = LeanTracerProvider(
        sampler=ParentBased(ALWAYS_ON if recorded else TraceIdRatioBased(0.0)))
    provider.add_span_processor(BatchSpanProcessor(
        EncodingExporter(encode=variant == "on"),
        max_export_batch_size=tracing.EXPORT_BATCH_SPANS,
        schedule_delay_millis=tracing.EXPORT_DELAY_MS))
    return provider


def take_headers_apart(variant: str) -> None:
    """`header` and `noheader`: the services' inject and extract replaced (this process
    only), so the messages carry a constant header or none."""
    if variant == "header":
        tracing.inject = lambda: None if not tracing.is_enabled() else dict(TRACEPARENT)
    elif variant == "noheader":
        tracing.inject = lambda: None
    if variant in ("header", "noheader"):
        tracing.extract = lambda headers: None


async def window(session: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> float:
    """CPU microseconds per request over one window (the clients' own included, the same
    in every mode: `bench.control_path`'s streamed requests)."""
    numbers = iter(range(args.requests))

    async def client() -> None:
        for i in numbers:
            await one_request(session, url, args.max_tokens, i)

    started = time.process_time()
    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return (time.process_time() - started) / args.requests * 1e6


@contextlib.asynccontextmanager
async def stack_in_process(variant: str) -> AsyncIterator[
        tuple[str, aiohttp.ClientSession, LeanTracerProvider]]:
    """Every service in this process on a real nats-server: the gateway's URL, a client
    session, and `variant`'s provider (tracing off until the caller installs it); all of it
    stopped, and tracing uninstalled, after the block."""
    propagate.set_global_textmap(TraceContextTextMapPropagator())  # as `configure_tracing`
    provider = provider_for(variant)
    server = EmbeddedNatsServer()
    server.start()
    try:
        async with Stack(server.url) as stack, aiohttp.ClientSession() as session:
            yield stack.gateway.url, session, provider
    finally:
        tracing.uninstall()
        provider.shutdown()
        server.stop()


async def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    take_headers_apart(args.variant)
    per_request: dict[str, list[float]] = {"off": [], args.variant: []}
    async with stack_in_process(args.variant) as (url, session, provider):
        await window(session, url, args)  # warm-up
        for round_ in range(args.rounds):
            order = ("off", args.variant) if round_ % 2 == 0 else (args.variant, "off")
            for mode in order:
                if mode == "off":
                    tracing.uninstall()
                else:
                    tracing.install(provider)
                per_request[mode].append(await window(session, url, args))
                provider.force_flush()
    return per_request


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--variant", choices=VARIANTS, default="on")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=300, help="per window")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    configure_logging("warning")
    per_request = asyncio.run(measure(args))
    for mode, values in per_request.items():
        print(f"{mode:>9}  CPU us per request, by window: "
              + " ".join(f"{value:.0f}" for value in values))
    off, traced = (statistics.median(per_request[mode]) for mode in ("off", args.variant))
    print(f"{args.variant} - off: {traced - off:+.0f} us per request on {off:.0f} "
          f"({traced / off:.3f}x), medians of {args.rounds} windows each")


if __name__ == "__main__":
    main()
