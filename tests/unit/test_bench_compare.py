from __future__ import annotations

from dataclasses import replace

from bench.client import RequestRecord
from bench.compare import Run, at_load, in_device_time, in_turns, ratio_table, reference_load
from bench.planner_compare import goodput_table
from bench.results import Slo, summarize
from bench.utilization import WorkerUtilization
from bench.workload import BenchRequest


def run(setup: str, load: float, ttft_s: float, itl_s: float, utilization: float,
        num_ok: int = 10) -> Run:
    records = [RequestRecord(sent_at_s=0.0, num_prompt_tokens=8, max_tokens=3,
                             chunk_times_s=[ttft_s, ttft_s + itl_s, ttft_s + 2 * itl_s],
                             end_s=ttft_s + 2 * itl_s, num_output_tokens=3)
               for _ in range(num_ok)]
    records += [RequestRecord(sent_at_s=0.0, num_prompt_tokens=8, max_tokens=3,
                              status="error") for _ in range(10 - num_ok)]
    return Run(setup, load, summarize(records, 10.0, Slo(ttft_ms=500, itl_ms=50)), records,
               [WorkerUtilization("w", "decode", utilization)])


def test_arrivals_compress_with_load_and_stretch_with_time_scale() -> None:
    requests = [BenchRequest([1], 1, 0.0), BenchRequest([1], 1, 2.0)]
    assert [r.arrival_s for r in at_load(requests, 2.0, 10.0)] == [0.0, 10.0]


def test_times_are_reported_in_the_devices_time() -> None:
    record = RequestRecord(sent_at_s=20.0, num_prompt_tokens=1, max_tokens=2,
                           chunk_times_s=[1.0, 3.0], end_s=3.0, num_output_tokens=2)
    scaled = in_device_time(record, 10.0)
    assert (scaled.sent_at_s, scaled.chunk_times_s, scaled.end_s) == (2.0, [0.1, 0.3], 0.3)


def test_reference_load_is_the_highest_both_setups_still_serve() -> None:
    runs = [run("colocated", 1, 0.1, 0.01, 0.5), run("colocated", 2, 0.2, 0.02, 0.6),
            run("colocated", 3, 0.9, 0.02, 0.7, num_ok=5),  # half fail: over capacity
            run("disaggregated", 1, 0.1, 0.01, 0.4), run("disaggregated", 2, 0.1, 0.01, 0.4),
            run("disaggregated", 3, 0.1, 0.01, 0.4)]
    assert reference_load(runs) == 2
    runs.append(run("disaggregated", 2, 0.9, 0.01, 0.4, num_ok=5))
    assert reference_load(runs) == 1


def test_the_table_gives_colocated_over_disaggregated_ratios() -> None:
    runs = [run("colocated", 1, 0.4, 0.04, 0.5), run("disaggregated", 1, 0.1, 0.01, 0.4),
            run("colocated", 2, 0.9, 0.09, 0.6, num_ok=4),
            run("disaggregated", 2, 0.2, 0.02, 0.8)]
    table = ratio_table(runs)
    def line(start: str) -> str:
        return next(row for row in table.splitlines() if row.startswith(start))

    assert "4.00x" in line("TTFT p99 ms, load 1 ")  # 400 ms against 100 ms
    assert "4.50x" in line("TTFT p99 ms, load 2 ")
    assert "4.00x" in line("ITL p99 ms, load 1 ")
    # Best goodput: 1 req/s each (colocated at load 1, disaggregated at both).
    assert "1.00x" in line("throughput at SLO")
    assert "0.80x" in line("utilization")  # at those loads: 40 % against 50 %


def test_the_planners_timelines_count_workers_per_role_and_model_to_the_runs_end() -> None:
    from bench.planner_compare import models_over_time, split_over_time

    planner = replace(run("planner", 1, 0.1, 0.01, 0.5), roles=[
        (0.0, "w1", "prefill"), (0.0, "w2", "decode"), (2.0, "w2", "prefill")], models=[
        (0.0, "w1", "a"), (0.0, "w2", "b"), (3.0, "w2", "a")])
    # Workers seen at one instant (the start) count together, not one by one.
    assert split_over_time(planner) == [(0.0, 1), (2.0, 2), (10.0, 2)]
    assert models_over_time(planner) == [(0.0, {"a": 1, "b": 1}), (3.0, {"a": 2}),
                                         (10.0, {"a": 2})]


def test_with_repeats_the_planner_is_compared_with_the_split_best_on_average() -> None:
    # Goodput is num_ok / 10 s. 6+2 has the one best run (1.0) but 7+1 the best mean.
    goodputs = {"colocated": [5, 5], "6+2": [10, 5], "7+1": [8, 9], "planner": [10, 7]}
    runs = [run(setup, 3, 0.1, 0.01, 0.5, num_ok=ok)
            for repeat in range(2) for setup, oks in goodputs.items() for ok in [oks[repeat]]]
    (summary,) = [row for row in goodput_table(runs).splitlines() if row.startswith("load 3")]
    assert summary == ("load 3: planner goodput 0.85, the mean of 1.00 0.70 req/s = 1.00x the "
                       "best static split (7+1: 0.85, the mean of 0.80 0.90), 1.70x colocated "
                       "(0.50, the mean of 0.50 0.50); run by run: 1.25x, 0.78x")


def test_repeated_setups_run_in_turns_back_and_forth() -> None:
    assert in_turns(["colocated", "7+1", "planner"], 3) == [
        "colocated", "7+1", "planner", "planner", "7+1", "colocated",
        "colocated", "7+1", "planner"]
    assert in_turns(["a", "b"], 1) == ["a", "b"]
