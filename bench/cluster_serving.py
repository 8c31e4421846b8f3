"""halfmoon serving across hosts of a network-namespace bed, against the same on one host,
and with a NATS node lost under load (scenarios (b) and (c) of `bench.cluster`).

The bed has 3 hosts for a routed NATS cluster (JetStream assets replicated 3 times) and 2 + 2
hosts for workers: prefill on hosts 3 and 4 (the conductor on 3, the gateway on 4), decode on
5 and 6, every link shaped to `--rate-mbit`. The workers run the built-in model on the torch
engine, so each request's KV crosses hosts over TCP. The one-host baseline runs the same
processes on one host (one NATS node; KV over shared memory). Both serve the same seeded
Poisson stream of streamed completions; the table gives TTFT and ITL percentiles.

The fault rows run the stream on the bed again and, a few seconds in, SIGKILL the NATS node on
host 0 (started again 5 s later: it rejoins) or cut host 1's link (healed 5 s later): requests
sent, completed and failed, and recovery: from the fault to the first token of the first
request sent after it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.client import RequestRecord
from bench.cluster import BedCluster, Placement
from bench.netbed import NetBed
from bench.results import Slo, Summary
from bench.serve import benchmark
from bench.workload import SyntheticSpec, synthetic

ACROSS_HOSTS = Placement(nats=(0, 1, 2), conductor=3, gateway=4, prefill=(3, 4), decode=(5, 6))
ONE_HOST = Placement(nats=(0,), conductor=0, gateway=0, prefill=(0, 0), decode=(0, 0))
FAULT_AT_S = 3.0  # into the stream
HEAL_AFTER_S = 5.0


@dataclass(frozen=True)
class StreamSettings:
    model_dir: Path
    num_requests: int = 60
    rate: float = 4.0  # requests/s, Poisson
    input_len: int = 96
    output_len: int = 32
    rate_mbit: float = 10_000
    seed: int = 0


@dataclass(frozen=True)
class FaultRow:
    name: str
    num_sent: int
    num_completed: int
    num_failed: int
    recovery_s: float
    errors: tuple[str, ...] = ()  # the distinct failures, as the client saw them


def _cluster(bed: NetBed, placement: Placement, settings: StreamSettings) -> BedCluster:
    """Started, and warmed up: one request served end to end (a routed NATS cluster can
    still be electing its JetStream leaders when every service reports ready)."""
    for host in bed.hosts:
        bed.shape(host, settings.rate_mbit)
    worker = ["--engine", "torch", "--model-path", str(settings.model_dir), "--num-blocks", "512"]
    cluster = BedCluster(bed, placement, worker_flags=worker,
                         gateway_flags=["--model-path", str(settings.model_dir)]).start()
    warm_up = synthetic(SyntheticSpec(num_requests=2, input_len=16, output_len=4))
    for attempt in range(3):
        summary, _ = asyncio.run(benchmark(cluster.gateway_url, warm_up, Slo()))
        if summary.num_ok == len(warm_up):
            return cluster
        time.sleep(2.0 * (attempt + 1))
    cluster.close()
    raise RuntimeError("the cluster does not serve after start-up")


def _stream(cluster: BedCluster, settings: StreamSettings,
            fault: Callable[[], None] | None = None) -> tuple[Summary, list[RequestRecord]]:
    """The seeded stream against `cluster`; `fault()` (in a thread) `FAULT_AT_S` in."""
    requests = synthetic(SyntheticSpec(
        num_requests=settings.num_requests, input_len=settings.input_len,
        output_len=settings.output_len, range_ratio=0.5, rate=settings.rate,
        seed=settings.seed))

    async def run() -> tuple[Summary, list[RequestRecord]]:
        measured = asyncio.create_task(benchmark(cluster.gateway_url, requests, Slo()))
        if fault is not None:
            await asyncio.sleep(FAULT_AT_S)
            await asyncio.to_thread(fault)
        return await measured

    return asyncio.run(run())


def stream_rows(settings: StreamSettings) -> dict[str, Summary]:
    """The stream across hosts and on one host."""
    summaries = {}
    for name, num_hosts, placement in (("across hosts", 7, ACROSS_HOSTS),
                                       ("one host", 1, ONE_HOST)):
        with NetBed(num_hosts) as bed:
            cluster = _cluster(bed, placement, settings)
            try:
                summaries[name] = _stream(cluster, settings)[0]
            finally:
                cluster.close()
    return summaries


def fault_rows(settings: StreamSettings) -> list[FaultRow]:
    """The stream across hosts with a NATS node killed, then with a NATS host cut off."""
    rows = []
    faults: dict[str, Callable[[BedCluster], Callable[[], None]]] = {
        "SIGKILL NATS node": _kill_and_restart, "partition NATS host": _cut_and_heal}
    for name, make_fault in faults.items():
        with NetBed(7) as bed:
            cluster = _cluster(bed, ACROSS_HOSTS, settings)
            try:
                _, records = _stream(cluster, settings, make_fault(cluster))
            finally:
                cluster.close()
        rows.append(_fault_row(name, records))
    return rows


def _kill_and_restart(cluster: BedCluster) -> Callable[[], None]:
    def fault() -> None:
        cluster.kill_nats(0)
        time.sleep(HEAL_AFTER_S)
        cluster.start_nats(0)
    return fault


def _cut_and_heal(cluster: BedCluster) -> Callable[[], None]:
    bed = cluster.bed

    def fault() -> None:
        bed.cut(bed.hosts[1])
        time.sleep(HEAL_AFTER_S)
        bed.heal(bed.hosts[1])
    return fault


def _fault_row(name: str, records: list[RequestRecord]) -> FaultRow:
    after = sorted((r for r in records if r.sent_at_s >= FAULT_AT_S and r.status == "ok"),
                   key=lambda r: r.sent_at_s + r.ttft_s)
    recovery_s = after[0].sent_at_s + after[0].ttft_s - FAULT_AT_S if after else math.nan
    completed = sum(r.status == "ok" and r.num_output_tokens == r.max_tokens for r in records)
    errors = tuple(sorted({r.error or f"{r.num_output_tokens} of {r.max_tokens} tokens"
                           for r in records if r.status != "ok"
                           or r.num_output_tokens != r.max_tokens}))
    return FaultRow(name, len(records), completed, len(records) - completed, recovery_s, errors)


STREAM_HEADER = (f"{'setup':>13} {'sent':>5} {'ok':>4} {'TTFT p50':>9} {'TTFT p99':>9} "
                 f"{'ITL p50':>8} {'ITL p99':>8}")


def format_stream(name: str, summary: Summary) -> str:
    return (f"{name:>13} {summary.num_requests:>5} {summary.num_ok:>4} "
            f"{summary.ttft.p50:>7.1f}ms {summary.ttft.p99:>7.1f}ms "
            f"{summary.itl.p50:>6.1f}ms {summary.itl.p99:>6.1f}ms")


FAULT_HEADER = f"{'fault':>20} {'sent':>5} {'completed':>9} {'failed':>6} {'recovery':>9}"


def format_fault(row: FaultRow) -> str:
    return (f"{row.name:>20} {row.num_sent:>5} {row.num_completed:>9} {row.num_failed:>6} "
            f"{row.recovery_s:>8.2f}s  {'; '.join(row.errors)}")
