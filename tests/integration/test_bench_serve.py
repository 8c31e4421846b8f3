"""`halfmoon bench serve` against a real stack of simulated-accelerator workers."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench.client import CompletionClient
from bench.results import Slo
from bench.serve import benchmark, main, run_requests
from bench.utilization import UtilizationProbe
from bench.workload import SyntheticSpec, synthetic
from engine.sim_cost import PROFILES
from tests.stack import Stack

PROFILE = PROFILES["llama-3-8b-h200"]
SIM_WORKER = {"engine": "sim", "sim_profile": PROFILE.name}


@pytest.fixture
async def sim_stack(nats_url: str) -> AsyncIterator[Stack]:
    async with Stack(nats_url, worker=SIM_WORKER) as running:
        yield running


def poisson(num: int = 12, rate: float = 30.0) -> SyntheticSpec:
    return SyntheticSpec(num_requests=num, input_len=400, output_len=12, range_ratio=0.5,
                         rate=rate, seed=1)


async def test_every_request_is_timed_and_counted(sim_stack: Stack) -> None:
    requests = synthetic(poisson())
    summary, records = await benchmark(sim_stack.gateway.url, requests, Slo(2000, 200))
    assert summary.num_ok == len(requests) and summary.num_errors == 0
    assert [r.num_output_tokens for r in records] == [r.max_tokens for r in requests]
    assert [len(r.chunk_times_s) for r in records] == [r.max_tokens for r in requests]
    shortest_prefill_s = PROFILE.prefill_s([(200, 0)])
    assert min(r.ttft_s for r in records) >= shortest_prefill_s
    assert summary.itl.p50 >= 1000 * PROFILE.decode_s([200]) * 0.9  # ms: the sim's step
    assert summary.slo_attainment == 1.0
    assert summary.goodput_requests_per_s == pytest.approx(summary.requests_per_s)
    # The KV moved, scaled down, through the transfer engine.
    assert sum(sim_stack.decodes[0].kv_commits.values()) == len(requests)
    assert "local" not in sim_stack.decodes[0].kv_commits


async def test_utilization_comes_from_the_heartbeats(sim_stack: Stack, nats_url: str) -> None:
    probe = UtilizationProbe(nats_url, cluster=sim_stack.cluster)
    await probe.start()
    try:
        await probe.wait_for_workers(2)
        start = probe.snapshot()
        await benchmark(sim_stack.gateway.url, synthetic(poisson(num=20, rate=40)), Slo())
        utilization = {u.role: u.utilization for u in await probe.since(start, settle_s=0.5)}
    finally:
        await probe.close()
    assert set(utilization) == {"prefill", "decode"}
    assert 0 < utilization["prefill"] < utilization["decode"] <= 1.0


async def test_closed_loop_keeps_that_many_requests_in_flight(sim_stack: Stack) -> None:
    requests = synthetic(SyntheticSpec(num_requests=5, input_len=100, output_len=4))
    client = CompletionClient(sim_stack.gateway.url, "halfmoon-tiny")
    try:
        records, _ = await run_requests(client, requests, concurrency=1)
    finally:
        await client.close()
    for earlier, later in itertools.pairwise(records):
        assert later.sent_at_s >= earlier.sent_at_s + earlier.end_s


async def test_rejections_are_counted_apart_from_errors(nats_url: str) -> None:
    async with Stack(nats_url, worker=SIM_WORKER,
                     conductor_options={"ttft_slo_ms": 0.001}) as stack:
        # The SLO admission needs a measured prefill cost: one request teaches it.
        await benchmark(stack.gateway.url, synthetic(poisson(num=1)), Slo())
        await stack.wait_healthy()
        summary, records = await benchmark(stack.gateway.url, synthetic(poisson(num=4)), Slo())
    assert summary.num_rejected == 4 and summary.num_errors == 0 and summary.num_ok == 0
    assert all(r.http_status == 429 and "TTFT" in r.error for r in records)


async def test_the_command_writes_results_and_plots(sim_stack: Stack, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    argv = ["--url", sim_stack.gateway.url, "--rate", "30", "--num-requests", "6",
            "--input-len", "300", "--output-len", "8", "--slo-ttft-ms", "5000",
            "--out", str(tmp_path), "--no-progress"]
    assert await asyncio.to_thread(main, argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["summary"]["num_ok"] == 6 and len(results["requests"]) == 6
    for name in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput" in capsys.readouterr().out


async def test_sim_kv_handoffs_take_the_full_bytes_time_on_the_link(nats_url: str) -> None:
    link_bytes_per_s = 1e9
    async with Stack(nats_url, worker={**SIM_WORKER, "sim_link_bytes_per_s": link_bytes_per_s}
                     ) as stack:
        requests = synthetic(SyntheticSpec(num_requests=1, input_len=2000, output_len=2))
        summary, _ = await benchmark(stack.gateway.url, requests, Slo())
        registry = stack.prefills[0].metrics.registry
        seconds = registry.get_sample_value("halfmoon_kv_transfer_seconds_sum",
                                            {"transport": "shm"})
    assert summary.num_ok == 1
    full_bytes = 2000 * PROFILE.kv_bytes_per_token  # 262 MB: 0.26 s at 1 GB/s
    assert seconds >= 0.9 * full_bytes / link_bytes_per_s
