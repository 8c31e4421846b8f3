"""Observability end to end: one connected trace per request across the four services and
the KV transfer; spans exported over OTLP (HTTP and gRPC) into real receivers; Prometheus
metrics that parse and count a known workload; logs that carry the trace ids."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import pytest
import rotel
from opentelemetry import propagate
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import StatusCode
from oteltap import OtelTapHttpProtobufReceiver, OtelTapHttpProtobufReceiverSettings
from prometheus_client.parser import text_string_to_metric_families

from bench.control_path import launch
from shared import tracing
from shared.lean_tracer import LeanTracerProvider
from shared.messages import StreamQuery, StreamStatus
from shared.nats_client import encode, subscribed
from shared.nats_server import free_port
from tests.integration.test_events import subscriber
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
ROTEL_AGENT = Path(rotel.__file__).parent / "rotel-agent"  # the collector's binary


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = LeanTracerProvider()  # what `configure_tracing` installs
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


def trace_of(spans: list[ReadableSpan], root_name: str) -> list[ReadableSpan]:
    (root,) = [s for s in spans if s.name == root_name]
    return [s for s in spans if s.context.trace_id == root.context.trace_id]


async def test_a_request_is_one_connected_trace_across_every_service_and_the_transfer(
        spans: InMemorySpanExporter, torch_stack: Stack) -> None:
    status, body = await torch_stack.post("/v1/completions", {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True},
        headers={"X-Request-Id": "client-trace-1"})
    assert status == 200, body
    await eventually(lambda: any(s.name == "gateway.request" for s in spans.get_finished_spans()))
    finished = list(spans.get_finished_spans())
    trace = trace_of(finished, "gateway.request")
    root = next(s for s in trace if s.name == "gateway.request")
    assert (root.attributes or {})["halfmoon.x_request_id"] == "client-trace-1"  # found by it
    # The request as OpenTelemetry's GenAI conventions name it.
    gen_ai = {k: v for k, v in (root.attributes or {}).items() if k.startswith("gen_ai.")}
    assert gen_ai == {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": MODEL,
                      "gen_ai.request.max_tokens": 4, "gen_ai.usage.output_tokens": 4,
                      "gen_ai.usage.input_tokens": body["usage"]["prompt_tokens"]}
    names = {s.name for s in trace}
    assert names >= {"gateway.request", "conductor.schedule", "prefill.request",
                     "kv.transfer", "decode.stream"}
    # Queueing, compute, the reservation and the first step are attributes and events.
    assert not names & {"prefill.queue", "prefill.compute", "decode.reserve",
                        "decode.first_step"}
    # Connected: every span but the root has its parent in the same trace.
    ids = {s.context.span_id for s in trace}
    roots = [s for s in trace if s.parent is None or s.parent.span_id not in ids]
    assert [s.name for s in roots] == ["gateway.request"]
    scopes = {s.instrumentation_scope.name.split(".")[0:2][-1] for s in trace}
    assert scopes >= {"gateway", "conductor", "prefill", "decode", "kv_handoff"}
    by_name = {s.name: s for s in trace}
    transfer = by_name["kv.transfer"].attributes or {}
    assert transfer["kv.bytes"] > 0 and transfer["kv.transport"] == "shm"
    assert transfer["kv.gbps"] > 0 and transfer["kv.compression"] == "none"
    # Decode's span follows the transfer: `KvCommitted` carried the transfer span's context.
    assert by_name["decode.stream"].parent.span_id == by_name["kv.transfer"].context.span_id
    assert by_name["kv.transfer"].parent.span_id == by_name["prefill.request"].context.span_id
    layers = [e for e in by_name["prefill.request"].events if e.name == "layer"]
    num_layers = torch_stack.prefills[0].engine.kv_layout().num_layers  # type: ignore[union-attr]
    assert [e.attributes["layer"] for e in layers] == list(range(num_layers))  # type: ignore[index]
    prefill = by_name["prefill.request"]
    assert (prefill.attributes or {})["halfmoon.queue_s"] >= 0
    assert prefill.events[0].name == "compute"
    stream = by_name["decode.stream"]
    assert [e.name for e in stream.events] == ["reserved", "first_step"]
    assert stream.events[0].timestamp <= stream.start_time  # reserved before the KV came
    schedule = by_name["conductor.schedule"].attributes or {}
    assert schedule["halfmoon.prefill_worker"] == torch_stack.prefills[0].worker_id
    assert schedule["halfmoon.decode_worker"] == torch_stack.decodes[0].worker_id


async def test_a_decode_worker_that_prefills_itself_joins_the_trace_under_the_conductor(
        spans: InMemorySpanExporter, nats_url: str) -> None:
    async with Stack(nats_url, num_prefill=0, worker={"local_prefill_max_tokens": 1 << 20}
                     ) as stack:
        status, body = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": "hello", "max_tokens": 3})
        assert status == 200, body
        await eventually(lambda: any(s.name == "decode.stream"
                                     for s in spans.get_finished_spans()))
    by_name = {s.name: s for s in trace_of(list(spans.get_finished_spans()),
                                           "gateway.request")}
    # Its reservation carried the conductor's context (a paired one goes without).
    schedule, stream = by_name["conductor.schedule"], by_name["decode.stream"]
    assert stream.parent is not None and stream.parent.span_id == schedule.context.span_id


async def test_the_roots_output_tokens_count_every_choice(spans: InMemorySpanExporter,
                                                           torch_stack: Stack) -> None:
    status, body = await torch_stack.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 3,
        "max_tokens": 4, "ignore_eos": True})
    assert status == 200, body
    await eventually(lambda: any(s.name == "gateway.request"
                                 for s in spans.get_finished_spans()))
    (root,) = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    attributes = root.attributes or {}
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 12


async def test_a_request_that_lost_its_decode_worker_says_so_in_its_trace_and_events(
        spans: InMemorySpanExporter, nats_url: str) -> None:
    """A reader of the trace sees where the request moved, and a subscriber which worker
    it lost; the lost worker's own span dies with it."""
    async with Stack(nats_url, num_decode=2, worker={"fake_token_delay_s": 0.02}) as stack, \
            subscriber(stack) as events:
        body = {"model": MODEL, "prompt": "moving on", "max_tokens": 60, "ignore_eos": True}
        request = asyncio.ensure_future(stack.post("/v1/completions", body))
        await eventually(lambda: any(d.engine.stats().num_running for d in stack.decodes))
        (lost,) = [d for d in stack.decodes if d.engine.stats().num_running]
        await lost._cancel_tasks()  # the process dies: no heartbeat, no token
        await lost.nc.close()
        status, _ = await request
        assert status == 200
        await eventually(lambda: any(s.name == "gateway.request"
                                     for s in spans.get_finished_spans()))
    trace = trace_of(list(spans.get_finished_spans()), "gateway.request")
    root = next(s for s in trace if s.name == "gateway.request")
    (migrated,) = [e for e in root.events if e.name == "migrated"]
    attributes = migrated.attributes or {}
    assert attributes["halfmoon.lost_worker"] == lost.worker_id
    assert attributes["halfmoon.attempt"] == 1 and attributes["halfmoon.output_tokens"] > 0
    schedules = sorted((s for s in trace if s.name == "conductor.schedule"),
                       key=lambda s: s.start_time or 0)
    assert [(s.attributes or {}).get("halfmoon.attempt") for s in schedules] == [None, 1]
    assert (schedules[1].attributes or {})["halfmoon.output_offset"] == \
        attributes["halfmoon.output_tokens"]
    kinds = [e.kind for e in events if e.kind in ("migrated", "placed")]
    assert kinds == ["placed", "migrated", "placed"]  # the move before its new placement
    (event,) = [e for e in events if e.kind == "migrated"]
    assert (event.lost_worker_id, event.attempt) == (lost.worker_id, 1)


async def test_a_stream_that_fails_after_its_first_token_is_an_error_span(
        spans: InMemorySpanExporter, nats_url: str) -> None:
    """Its HTTP status (200) went out with the first chunk; the span still says it failed."""
    async with Stack(nats_url, num_decode=1, worker={"fake_token_delay_s": 0.02},
                     conductor_options={"no_worker_hold_s": 0.5}) as stack:
        body = {"model": MODEL, "prompt": "no one left", "max_tokens": 60, "stream": True,
                "ignore_eos": True}
        decode = stack.decodes[0]
        async with aiohttp.ClientSession() as session, session.post(
                f"{stack.gateway.url}/v1/completions", json=body) as response:
            assert response.status == 200
            await response.content.readline()  # the first chunk
            await decode._cancel_tasks()  # the only decode worker dies: nowhere to go
            await decode.nc.close()
            rest = (await response.read()).decode()
        assert '"error"' in rest
        await eventually(lambda: any(s.name == "gateway.request"
                                     for s in spans.get_finished_spans()), timeout_s=30)
    (root,) = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    assert root.status.status_code is StatusCode.ERROR
    assert (root.status.description or "").startswith("WorkerUnavailable: ")


async def test_clients_that_leave_mid_stream_are_499s_and_no_server_error(
        spans: InMemorySpanExporter, nats_url: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Tokens come as fast as the fake engine makes them, so a client's going is found by
    aiohttp's cancelling the handler or, first, by a write to the closed connection: either
    way a 499, with no `http.unhandled` error logged and no error span (it was a 500 and an
    error with a traceback when a write found it)."""
    async with Stack(nats_url) as stack, aiohttp.ClientSession() as session:
        for i in range(12):
            body = {"model": MODEL, "prompt": f"leave {i}", "max_tokens": 400, "stream": True,
                    "ignore_eos": True}
            async with session.post(f"{stack.gateway.url}/v1/completions",
                                    json=body) as response:
                assert response.status == 200
                for _ in range(3):
                    await response.content.readline()
                response.close()
        await eventually(lambda: stack.gateway.metrics.registry.get_sample_value(
            "halfmoon_requests_total", {"route": "/v1/completions", "status": "499"}) == 12)
        await stack.wait_blocks_free()
        assert stack.gateway.metrics.registry.get_sample_value(
            "halfmoon_requests_total", {"route": "/v1/completions", "status": "500"}) is None
    roots = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    assert len(roots) == 12
    for root in roots:
        assert root.attributes["http.response.status_code"] == 499
    # Nor did any service fail: decode was told to stop (an `aborted` event on its span).
    assert {s.status.status_code for s in spans.get_finished_spans()} == {StatusCode.UNSET}
    streams = [s for s in spans.get_finished_spans() if s.name == "decode.stream"]
    assert streams and all("aborted" in [e.name for e in s.events] for s in streams)
    assert "http.unhandled" not in capsys.readouterr().err


async def test_a_cancelled_span_is_no_error(spans: InMemorySpanExporter) -> None:
    """A cancelled task was told to stop (an abort, the client gone, a shutdown)."""
    async def work() -> None:
        with tracing.span(__name__, "told.to.stop"):
            await asyncio.sleep(30)

    task = asyncio.ensure_future(work())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (span,) = spans.get_finished_spans()
    assert span.status.status_code is StatusCode.UNSET
    assert [event.name for event in span.events] == ["cancelled"]


async def test_only_a_5xx_makes_the_root_span_an_error(
        spans: InMemorySpanExporter, nats_url: str) -> None:
    """OpenTelemetry's HTTP conventions for a server span: a 4xx is the client's."""
    async with Stack(nats_url, conductor_options={"no_worker_hold_s": 0.5}) as stack:
        status, _ = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                         "max_tokens": 2, "temperature": 9})
        assert status == 400
        for worker in [*stack.prefills, *stack.decodes]:
            await worker.stop()
        status, _ = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                         "max_tokens": 2})
        assert status == 503
    client_error, server_error = [s for s in spans.get_finished_spans()
                                  if s.name == "gateway.request"]
    assert client_error.attributes["http.response.status_code"] == 400
    assert client_error.status.status_code is StatusCode.UNSET
    assert "error.type" not in client_error.attributes
    assert server_error.attributes["http.response.status_code"] == 503
    assert server_error.status.status_code is StatusCode.ERROR
    assert server_error.attributes["error.type"] == "503"


@pytest.mark.parametrize("mode", ["otlp-grpc", "otlp-http"])
def test_a_stopping_process_gives_up_on_an_unreachable_collector(mode: str) -> None:
    """The exporter retries a batch for up to 10 s and the SDK's shutdown waits up to 30 s
    for it: a stopping service would wait that long for a collector that is down."""
    propagator = propagate.get_global_textmap()  # `configure_tracing` sets its own
    try:
        assert tracing.configure_tracing("gateway", "gw-test", mode=mode,
                                         endpoint=f"http://127.0.0.1:{free_port()}",
                                         sample_ratio=1.0)
        for _ in range(3):
            with tracing.span(__name__, "unsent"):
                pass
        started = time.monotonic()
        tracing.shutdown(flush_s=0.5)
        assert time.monotonic() - started < 4  # the exporter's own retries: 5.6 s or more
        assert not tracing.is_enabled()
    finally:
        tracing.shutdown()
        propagate.set_global_textmap(propagator)


async def test_with_tracing_off_no_span_is_made_and_no_header_sent(stack: Stack) -> None:
    assert not tracing.is_enabled()
    assert tracing.inject() is None
    status, _ = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                     "max_tokens": 2})
    assert status == 200


CLIENT_TRACE_ID, CLIENT_SPAN_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7


def client_traceparent(flags: str) -> dict[str, str]:
    """The headers of a client whose own span (an app instrumented with OpenTelemetry) is
    calling: W3C trace context."""
    return {"traceparent": f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-{flags}",
            "tracestate": "app=1"}


async def complete_with(stack: Stack, headers: dict[str, str]) -> None:
    status, body = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                        "max_tokens": 3}, headers=headers)
    assert status == 200, body


async def test_a_client_s_trace_context_is_continued_through_every_service(
        spans: InMemorySpanExporter, stack: Stack) -> None:
    await complete_with(stack, client_traceparent("01"))
    await eventually(lambda: {"gateway.request", "decode.stream"} <= {
        s.name for s in spans.get_finished_spans()})
    trace = list(spans.get_finished_spans())
    assert {s.context.trace_id for s in trace} == {CLIENT_TRACE_ID}
    (root,) = [s for s in trace if s.name == "gateway.request"]
    assert root.parent is not None and root.parent.span_id == CLIENT_SPAN_ID
    assert root.parent.is_remote and root.context.trace_state.get("app") == "1"
    ids = {s.context.span_id for s in trace}
    assert [s.name for s in trace if s.parent.span_id not in ids] == ["gateway.request"]
    assert {s.name for s in trace} >= {"conductor.schedule", "prefill.request",
                                       "decode.stream"}


async def test_a_client_that_does_not_sample_its_trace_leaves_no_span(
        spans: InMemorySpanExporter, stack: Stack) -> None:
    await complete_with(stack, client_traceparent("00"))
    await asyncio.sleep(0.2)  # a span would have ended with the stream
    assert spans.get_finished_spans() == ()


async def test_a_malformed_client_trace_context_starts_a_trace_at_the_gateway(
        spans: InMemorySpanExporter, stack: Stack) -> None:
    await complete_with(stack, {"traceparent": "00-not-a-trace-01"})
    await eventually(lambda: any(s.name == "gateway.request"
                                 for s in spans.get_finished_spans()))
    (root,) = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    assert root.parent is None


async def test_a_gateway_told_not_to_continue_clients_traces_starts_its_own(
        spans: InMemorySpanExporter, nats_url: str) -> None:
    async with Stack(nats_url, gateway_options={"client_trace_context": False}) as stack:
        await complete_with(stack, client_traceparent("00"))
        await eventually(lambda: any(s.name == "gateway.request"
                                     for s in spans.get_finished_spans()))
    (root,) = [s for s in spans.get_finished_spans() if s.name == "gateway.request"]
    assert root.parent is None and root.context.trace_id != CLIENT_TRACE_ID


class DeclineTheGateway(Sampler):
    """Samples every root but the gateway's: a request the gateway did not sample would
    show any span made for it elsewhere, as a root of its own."""

    def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                      attributes: Any = None, links: Any = None,
                      trace_state: Any = None) -> SamplingResult:
        return SamplingResult(Decision.DROP if name == "gateway.request"
                              else Decision.RECORD_AND_SAMPLE)

    def get_description(self) -> str:
        return "DeclineTheGateway"


async def test_a_request_not_sampled_carries_no_context_and_leaves_no_span(
        stack: Stack) -> None:
    exporter = InMemorySpanExporter()
    provider = LeanTracerProvider(sampler=ParentBased(DeclineTheGateway()))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    nc = await nats.connect(stack.nats_url)
    carried: list[str] = []

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        if msg.headers and "traceparent" in msg.headers:
            carried.append(msg.subject)

    await nc.subscribe(">", cb=on_message)
    await subscribed(nc)
    tracing.install(provider)
    try:
        status, body = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                            "max_tokens": 3})
        assert status == 200, body
        await nc.flush()
        await asyncio.sleep(0.2)  # a span of its own would have ended with the stream
    finally:
        tracing.uninstall()
        provider.shutdown()
        await nc.close()
    assert carried == []  # no header block on the stream, the command or the KV commit
    assert exporter.get_finished_spans() == ()  # and no service started a trace of its own


async def test_a_traced_commands_reply_comes_back_without_its_headers(
        spans: InMemorySpanExporter, stack: Stack) -> None:
    """`msg.respond` would send the command's headers (its trace context) back with the
    reply: a header block built and parsed again on every traced hop, read by no one."""
    nc = await nats.connect(stack.nats_url)
    try:
        with tracing.span(__name__, "test.command"):
            headers = tracing.inject()
        assert headers is not None and "traceparent" in headers
        reply = await nc.request(stack.gateway.subjects.gateway_status(stack.gateway.gateway_id),
                                 encode(StreamQuery(request_id="cmpl-none", attempt=0)),
                                 timeout=5, headers=headers)
    finally:
        await nc.close()
    assert reply.headers is None
    status = msgspec.json.decode(reply.data, type=StreamStatus)
    assert not status.is_open


async def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed `name{label="value",...}`."""
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 200
        assert response.content_type == "text/plain"
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("halfmoon_"), family.name
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


async def test_metrics_parse_and_count_a_known_workload(stack: Stack) -> None:
    prompts = [[1 + i] * (20 + i) for i in range(3)]
    for prompt in prompts:
        status, _ = await stack.post("/v1/completions", {"model": MODEL, "prompt": prompt,
                                                         "max_tokens": 5})
        assert status == 200
    status, _ = await stack.post("/v1/completions", {"model": MODEL, "prompt": [1] * 20,
                                                     "max_tokens": 100_000})
    assert status == 400
    await stack.wait_blocks_free()
    (prefill,), (decode,) = stack.prefills, stack.decodes

    gateway = await scrape(f"{stack.gateway.url}/metrics")
    assert gateway['halfmoon_requests_total{route="/v1/completions",status="200"}'] == 3
    assert gateway['halfmoon_requests_total{route="/v1/completions",status="400"}'] == 1
    assert gateway["halfmoon_requests_in_flight"] == 0
    assert gateway["halfmoon_generation_tokens_total"] == 15
    assert gateway["halfmoon_prompt_tokens_total"] == sum(map(len, prompts))
    assert gateway["halfmoon_time_to_first_token_seconds_count"] == 3
    assert gateway["halfmoon_inter_token_latency_seconds_count"] == 3 * 4
    assert gateway["halfmoon_e2e_request_latency_seconds_count"] == 3

    assert stack.conductor.metrics_url is not None
    conductor = await scrape(stack.conductor.metrics_url)
    assert conductor['halfmoon_placements_total{path="disaggregated",policy="cache-aware",'
                     'prefix_fetch="false"}'] == 3
    assert conductor['halfmoon_workers_healthy{role="prefill"}'] == 1

    assert prefill.metrics_url is not None and decode.metrics_url is not None
    prefill_samples = await scrape(prefill.metrics_url)
    assert prefill_samples["halfmoon_prefill_prompt_tokens_total"] == sum(map(len, prompts))
    assert prefill_samples["halfmoon_queue_time_seconds_count"] == 3
    assert prefill_samples["halfmoon_kv_blocks_used"] == 0
    decode_samples = await scrape(decode.metrics_url)
    assert decode_samples['halfmoon_kv_commits_total{transport="none"}'] == 3
    assert decode_samples["halfmoon_decode_tokens_total"] == 3 * 4
    assert decode_samples["halfmoon_kv_blocks_free"] == decode.engine.stats().num_total_blocks
    assert decode_samples["halfmoon_preemptions_total"] == 0


async def test_slo_rejections_are_counted_by_reason(nats_url: str) -> None:
    async with Stack(nats_url, conductor_options={"ttft_slo_ms": 1.0},
                     worker={"fake_prefill_s_per_token": 0.01}) as stack:
        status, _ = await stack.post("/v1/completions", {"model": MODEL, "prompt": [5] * 40,
                                                         "max_tokens": 2})
        assert status == 429
        assert stack.conductor.metrics_url is not None
        samples = await scrape(stack.conductor.metrics_url)
        assert samples['halfmoon_rejections_total{reason="slo"}'] == 1


@pytest.fixture
async def tap() -> AsyncIterator[tuple[OtelTapHttpProtobufReceiver, int]]:
    """An OTLP/HTTP receiver (oteltap) in this process; yields it and its port."""
    port = free_port()
    async with OtelTapHttpProtobufReceiver(OtelTapHttpProtobufReceiverSettings(
            http_port=port)) as receiver:
        yield receiver, port


@pytest.fixture
def rotel_collector(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    """A rotel collector process taking OTLP/gRPC and printing every span it receives;
    yields its gRPC port and where it prints."""
    grpc_port, output = free_port(), tmp_path / "rotel.out"
    with output.open("w") as sink:
        process = subprocess.Popen(
            [str(ROTEL_AGENT), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
             "--otlp-http-endpoint", f"127.0.0.1:{free_port()}", "--exporter", "blackhole",
             "--debug-log", "traces", "--debug-log-verbosity", "detailed",
             "--pid-file", str(tmp_path / "rotel.pid"), "--log-file", str(tmp_path / "log")],
            stdout=sink, stderr=subprocess.STDOUT)
    yield grpc_port, output
    process.terminate()
    process.wait(timeout=10)


def rotel_spans(output: Path) -> dict[str, set[str]]:
    """Trace id -> span names, from the collector's detailed debug print."""
    traces: dict[str, set[str]] = {}
    trace_id = None
    for line in output.read_text().splitlines():
        if match := re.match(r"\s*Trace ID\s*: ([0-9a-f]{32})", line):
            trace_id = match.group(1)
        elif (match := re.match(r"\s*Name\s*: (\S+)", line)) and trace_id is not None:
            traces.setdefault(trace_id, set()).add(match.group(1))
    return traces


WANTED = {"gateway.request", "conductor.schedule", "prefill.request", "decode.stream"}


async def one_traced_request(*flags: str, received: Callable[[], dict[str, set[str]]]
                             ) -> tuple[str, list[dict[str, Any]]]:
    """Run `halfmoon up` with these tracing flags, send one request, wait until a receiver
    holds its trace; return the trace id and the cluster's JSON log records."""
    logs: list[str] = []
    process, url = await asyncio.to_thread(launch, "--engine", "fake", "--log-level", "debug",
                                           "--access-log", *flags, logs=logs)
    try:
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 3}) as response:
            assert response.status == 200
        await eventually(lambda: any(names >= WANTED for names in received().values()), 20)
        (trace_id,) = [t for t, names in received().items() if names >= WANTED]
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 30)
    return trace_id, [record for line in logs if (record := json_record(line))]


def json_record(line: str) -> dict[str, Any] | None:
    """A JSON log line; None for anything else (lines of several processes share a pipe)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def assert_logs_join_the_trace(records: list[dict[str, Any]], trace_id: str) -> None:
    about_request = [r for r in records if r.get("trace_id") == trace_id]
    assert {r["event"] for r in about_request} >= {"prefill.committed", "decode.kv_committed",
                                                   "http.request"}
    assert all((r.get("request_id") or r.get("x_request_id")) and r.get("span_id")
               for r in about_request)
    (access,) = [r for r in about_request if r["event"] == "http.request"]
    assert access["status"] == 200 and access["duration_ms"] > 0


async def test_spans_reach_an_otlp_http_receiver_and_logs_carry_their_trace_ids(
        tap: tuple[OtelTapHttpProtobufReceiver, int]) -> None:
    receiver, port = tap
    received: dict[str, set[str]] = {}

    async def collect() -> None:
        async for span in receiver.stream_traces():
            received.setdefault(span.trace_id.hex(), set()).add(span.name)

    collector = asyncio.ensure_future(collect())
    try:
        trace_id, records = await one_traced_request(
            "--tracing", "otlp-http", "--otlp-endpoint", f"http://127.0.0.1:{port}",
            received=lambda: received)
    finally:
        collector.cancel()
    assert_logs_join_the_trace(records, trace_id)


async def test_spans_reach_an_otlp_grpc_collector_process(
        rotel_collector: tuple[int, Path]) -> None:
    port, output = rotel_collector
    trace_id, records = await one_traced_request(
        "--tracing", "otlp-grpc", "--otlp-endpoint", f"http://127.0.0.1:{port}",
        received=lambda: rotel_spans(output))
    assert_logs_join_the_trace(records, trace_id)


async def test_every_service_answers_health_beside_its_metrics(nats_url: str) -> None:
    stack = Stack(nats_url)
    async with stack:
        for service in (stack.conductor, *stack.prefills, *stack.decodes):
            assert service.metrics_url is not None
            url = service.metrics_url.replace("/metrics", "/health")
            async with aiohttp.ClientSession() as session, session.get(url) as response:
                body = await response.json()
            assert response.status == 200, body
            assert body["status"] == "ok" and body["nats_connected"] is True
            assert body["id"] == service.instance_id
        decode = stack.decodes[0]
        await decode.nc.close()  # cut off from NATS: not ready
        url = (decode.metrics_url or "").replace("/metrics", "/health")
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 503
            assert (await response.json())["nats_connected"] is False
