"""Where a request's time to first token goes on the control path, hop by hop.

Starts `halfmoon up --engine fake` (zero model time: what is left is the control path, every
service its own process) twice: untraced, for the TTFT baseline, and exporting every span to
an OTLP/HTTP receiver in this process (oteltap). One client sends `--requests` streamed
completions one after another; each request's spans (one clock: one machine) split its TTFT
into hops:

    client -> gateway       the HTTP request reaches the gateway's handler
    gateway -> conductor    validate, tokenize, JetStream publish + ack, delivery to a conductor
    conductor -> prefill    placement, `PrefillTask` request to the prefill worker
    prefill                 its queue and the (fake, zero-time) prefill, until the first token
    prefill -> gateway      the first token's `TokenBatch` over NATS, the gateway's handler
    gateway -> client       the SSE chunk out, the client reading it

and prints each hop's median, the traced TTFT it sums to, and the untraced TTFT.

    python -m bench.control_path_profile --requests 200
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import time
from collections import defaultdict
from typing import Any

import aiohttp
from oteltap import OtelTapHttpProtobufReceiver, OtelTapHttpProtobufReceiverSettings

from bench.control_path import MODEL, launch
from shared.nats_server import free_port

HOPS = ("client -> gateway", "gateway -> conductor", "conductor -> prefill", "prefill",
        "prefill -> gateway", "gateway -> client")


async def timed_requests(url: str, num_requests: int) -> list[tuple[int, int]]:
    """(sent, first chunk read) in Unix ns, per request, one at a time."""
    times = []
    async with aiohttp.ClientSession() as session:
        for i in range(num_requests):
            body = {"model": MODEL, "prompt": f"profile {i}", "max_tokens": 4, "stream": True}
            sent = time.time_ns()
            first = 0
            async with session.post(f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.content:
                    if not first and line.startswith(b"data: {"):
                        first = time.time_ns()
            times.append((sent, first))
    return times


def _event_ns(span: Any, name: str) -> int:
    return next((e.time_unix_nano for e in span.events if e.name == name), 0)


def _attribute(span: Any, key: str) -> float:
    return next((a.value.double_value for a in span.attributes if a.key == key), 0.0)


def hops_of(spans: dict[str, Any], sent: int, first: int) -> dict[str, float] | None:
    """The hop durations (ms) of one trace, or None when a span is missing."""
    try:
        root, schedule, request = (spans["gateway.request"], spans["conductor.schedule"],
                                   spans["prefill.request"])
    except KeyError:
        return None
    computed = _event_ns(request, "compute") + int(_attribute(request, "halfmoon.compute_s")
                                                   * 1e9)
    marks = [sent, root.start_time_unix_nano, schedule.start_time_unix_nano,
             request.start_time_unix_nano, computed, _event_ns(root, "first_token"), first]
    if not all(marks):
        return None
    return {hop: (marks[i + 1] - marks[i]) / 1e6 for i, hop in enumerate(HOPS)}


async def profile(num_requests: int) -> tuple[dict[str, list[float]], list[float]]:
    port = free_port()
    async with OtelTapHttpProtobufReceiver(OtelTapHttpProtobufReceiverSettings(
            http_port=port)) as receiver:
        traces: dict[bytes, dict[str, Any]] = defaultdict(dict)

        async def collect() -> None:
            async for span in receiver.stream_traces():
                traces[span.trace_id][span.name] = span

        collector = asyncio.ensure_future(collect())
        process, url = await asyncio.to_thread(
            launch, "--engine", "fake", "--log-level", "warning", "--tracing", "otlp-http",
            "--otlp-endpoint", f"http://127.0.0.1:{port}")
        try:
            await timed_requests(url, 10)  # warm-up
            times = await timed_requests(url, num_requests)
            await asyncio.sleep(7)  # the exporters' batch delay (5 s), and some
        finally:
            process.send_signal(signal.SIGTERM)
            await asyncio.to_thread(process.wait, 60)
            collector.cancel()
    # Match traces to requests by time: the root span starts after the request was sent.
    roots = sorted((spans["gateway.request"].start_time_unix_nano, spans)
                   for spans in traces.values() if "gateway.request" in spans)
    hops: dict[str, list[float]] = defaultdict(list)
    ttfts = []
    for sent, first in times:
        matching = [spans for start, spans in roots if sent <= start <= first]
        if len(matching) == 1 and (found := hops_of(matching[0], sent, first)) is not None:
            for hop, ms in found.items():
                hops[hop].append(ms)
            ttfts.append((first - sent) / 1e6)
    return hops, ttfts


async def untraced_ttfts(num_requests: int) -> list[float]:
    process, url = await asyncio.to_thread(launch, "--engine", "fake", "--log-level",
                                           "warning", "--tracing", "off")
    try:
        await timed_requests(url, 10)
        return [(first - sent) / 1e6 for sent, first in await timed_requests(url,
                                                                               num_requests)]
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(process.wait, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args(argv)
    baseline = asyncio.run(untraced_ttfts(args.requests))
    hops, ttfts = asyncio.run(profile(args.requests))
    print(f"{len(ttfts)} of {args.requests} traced requests matched; medians:")
    for hop in HOPS:
        values = hops.get(hop) or [float("nan")]
        print(f"  {hop:<22} {statistics.median(values):7.3f} ms")
    traced = statistics.median(ttfts) if ttfts else float("nan")
    print(f"  {'sum (traced TTFT)':<22} {traced:7.3f} ms")
    print(f"  {'untraced TTFT':<22} {statistics.median(baseline):7.3f} ms")
    return 0


if __name__ == "__main__":
    main()
