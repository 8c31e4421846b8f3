from __future__ import annotations

import itertools
import json
import math
import random
import statistics
from pathlib import Path

import pytest

from bench.client import RequestRecord
from bench.results import Slo, percentile, summarize
from bench.trace import TraceScaling
from bench.workload import Phase, SyntheticSpec, arrival_times, from_trace, phased, synthetic


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def test_poisson_arrivals_have_the_asked_rate() -> None:
    times = arrival_times(4000, rate=5.0, burstiness=1.0, rng=random.Random(0))
    assert times[0] == 0.0
    assert statistics.mean(gaps(times)) == pytest.approx(0.2, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(gaps(times)) == pytest.approx(0.2, rel=0.1)


def test_low_burstiness_clusters_arrivals_at_the_same_rate() -> None:
    bursty = gaps(arrival_times(4000, rate=5.0, burstiness=0.25, rng=random.Random(0)))
    assert statistics.mean(bursty) == pytest.approx(0.2, rel=0.1)
    assert statistics.stdev(bursty) > 1.7 * 0.2  # coefficient of variation 1/sqrt(0.25)


def test_synthetic_lengths_stay_in_range_and_runs_repeat() -> None:
    spec = SyntheticSpec(num_requests=200, input_len=100, output_len=10, range_ratio=0.5,
                         rate=2.0, seed=4)
    requests = synthetic(spec)
    assert all(50 <= len(r.prompt_token_ids) <= 150 for r in requests)
    assert all(5 <= r.max_tokens <= 15 for r in requests)
    assert all(1 <= t <= 255 for r in requests for t in r.prompt_token_ids)
    assert synthetic(spec) == requests


def test_closed_loop_requests_have_no_arrival_time() -> None:
    requests = synthetic(SyntheticSpec(num_requests=3, input_len=4, output_len=2))
    assert [r.arrival_s for r in requests] == [None] * 3


@pytest.mark.parametrize("bad", [{"num_requests": 0}, {"range_ratio": 1.0}, {"rate": 0.0},
                                 {"burstiness": 0.0}])
def test_impossible_workloads_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        SyntheticSpec(**{"num_requests": 1, "input_len": 1, "output_len": 1, **bad})  # type: ignore[arg-type]


def test_a_trace_replays_scaled_with_shared_blocks_sharing_tokens(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
             {"timestamp": 1000, "input_length": 1000, "output_length": 8, "hash_ids": [1, 3]},
             {"timestamp": 3000, "input_length": 9000, "output_length": 8,
              "hash_ids": list(range(4, 22))}]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = from_trace(trace, TraceScaling(length_divisor=4, output_divisor=2,
                                              time_divisor=2.0), max_total_len=1000)
    assert [r.arrival_s for r in requests] == [0.0, 0.5]  # the third is too long
    first, second = requests
    assert first.prompt_token_ids[:128] == second.prompt_token_ids[:128]
    assert first.prompt_token_ids[128:] != second.prompt_token_ids[128:]
    assert (len(first.prompt_token_ids), len(second.prompt_token_ids)) == (256, 250)
    assert first.max_tokens == 4


def record(ttft_s: float, itls_s: list[float], status: str = "ok") -> RequestRecord:
    times = [ttft_s]
    for itl in itls_s:
        times.append(times[-1] + itl)
    return RequestRecord(sent_at_s=0.0, num_prompt_tokens=10, max_tokens=len(times),
                         status=status, chunk_times_s=times, end_s=times[-1],
                         num_output_tokens=len(times))


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.99) == 5.0
    assert math.isnan(percentile([], 0.5))


def test_goodput_counts_requests_within_both_slos() -> None:
    slo = Slo(ttft_ms=100, itl_ms=20)
    records = [record(0.05, [0.01] * 9),  # good
               record(0.2, [0.01] * 9),  # TTFT too long
               record(0.05, [0.01] * 18 + [0.5]),  # one slow token: its p90 still holds
               record(0.05, [0.05] * 9),  # a slow stream
               record(0.01, [], status="rejected")]
    summary = summarize(records, duration_s=2.0, slo=slo)
    assert (summary.num_ok, summary.num_rejected, summary.num_errors) == (4, 1, 0)
    assert summary.goodput_requests_per_s == pytest.approx(1.0)  # 2 good in 2 s
    assert summary.goodput_tokens_per_s == pytest.approx(15.0)  # 10 + 20 tokens
    assert summary.slo_attainment == pytest.approx(0.4)
    assert summary.output_tokens_per_s == pytest.approx(25.0)
    assert summary.ttft.p50 == pytest.approx(50.0)
    assert records[0].tpot_s == pytest.approx(0.01)


def test_phases_follow_each_other_at_the_rate() -> None:
    spec = SyntheticSpec(num_requests=1, input_len=1, output_len=1, rate=10.0, seed=3)
    requests = phased([Phase.parse("64:4:20"), Phase.parse("8:32:30")], spec)
    assert len(requests) == 50
    first, second = requests[:20], requests[20:]
    assert {len(r.prompt_token_ids) for r in first} == {64}  # range ratio 0
    assert {r.max_tokens for r in first} == {4} and {r.max_tokens for r in second} == {32}
    assert second[0].arrival_s == pytest.approx(2.0)  # 20 requests at 10/s
    arrivals = [r.arrival_s or 0.0 for r in requests]
    assert arrivals == sorted(arrivals)
    with pytest.raises(ValueError, match="INPUT:OUTPUT:NUM"):
        Phase.parse("64:4")
