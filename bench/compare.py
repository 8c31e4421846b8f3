"""`halfmoon bench compare`: colocated against disaggregated serving, same workers, same load.

    halfmoon bench compare --engine sim --workers 8 --prefill 4 --rate 8 --loads 0.5,1,1.5 \\
        --num-requests 300 --input-len 2048 --output-len 256 --range-ratio 0.5 \\
        --slo-ttft-ms 1000 --slo-itl-ms 50 --out compare/

For each setup and each load factor, starts a fresh `halfmoon up` (every service its own
process, embedded NATS): **colocated** (`--mode colocated --workers N`: every worker prefills
and decodes; prefill steps interrupt decode, as in vLLM) and **disaggregated** (`--prefill P
--decode N-P`, KV streamed layer by layer through the transfer engine). It replays the same
seeded workload at `load x` the base rate (a trace: `load x` faster), measures it with
`bench serve`'s client, and reads each worker's accelerator utilization from its heartbeats.

With `--engine sim` the workers simulate `--sim-profile` (`engine/sim_cost.py`) running
`--time-scale` times slower than real, so the host keeps up; arrivals are stretched by the
same factor and every time reported is divided by it, i.e. in the simulated device's time.
With `--engine torch` the workers run the built-in model on this machine's CPU.

Prints each run, then the seed's table as measured ratios: TTFT p99 and ITL p99 at each load,
throughput at the SLO (the best goodput over the loads) and utilization at that load; writes
`compare.json` and plots to `--out` (latency CDFs at the highest load at which both setups
meet the SLO for 90 % of requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench import planner_compare
from bench.client import RequestRecord
from bench.control_path import launched
from bench.results import Slo, Summary, summarize
from bench.serve import add_workload_flags, benchmark, build_workload
from bench.utilization import UtilizationProbe, WorkerUtilization
from bench.workload import BenchRequest
from shared.nats_server import free_port

SETUPS = ("colocated", "disaggregated")
ATTAINMENT_TARGET = 0.9


@dataclass
class Run:
    setup: str
    load: float
    summary: Summary
    records: list[RequestRecord]
    utilization: list[WorkerUtilization]
    # (device seconds from the start, worker id, role) whenever a worker took a role.
    roles: list[tuple[float, str, str]] = field(default_factory=list)
    # (device seconds from the start, worker id, model) whenever a worker took a model.
    models: list[tuple[float, str, str]] = field(default_factory=list)
    num_migrated: int = 0  # requests placed again mid-stream (shed or failed over)

    @property
    def mean_utilization(self) -> float:
        values = [w.utilization for w in self.utilization]
        return sum(values) / len(values) if values else float("nan")


def cluster_args(args: argparse.Namespace, setup: str) -> list[str]:
    """`halfmoon up` flags of a setup: `colocated`, `disaggregated` (the `--prefill`
    split), a static split `P+D`, or `planner` (`planner_compare.py`)."""
    flags = ["--engine", args.engine, "--log-level", "warning",
             "--max-model-len", str(args.max_model_len)]
    if args.engine == "sim":
        flags += ["--sim-profile", args.sim_profile, "--sim-time-scale", str(args.time_scale)]
    if args.planner:
        flags += planner_compare.conductor_flags(args, setup)
    models = args.models.split(",") if args.models else []
    for model in models:  # sim profiles: the workers are split evenly between them
        flags += ["--model", model]
    if models:
        flags += ["--sim-load-bytes-per-s", str(args.sim_load_bytes_per_s)]
    per_model = max(1, len(models))
    if setup == "colocated":
        return [*flags, "--mode", "colocated", "--workers", str(args.workers // per_model)]
    num_prefill = int(setup.split("+")[0]) if "+" in setup else args.prefill
    return [*flags, "--prefill", str(num_prefill // per_model), "--decode",
            str((args.workers - num_prefill) // per_model)]


# Wall-clock timeouts of the services, at their defaults: a slowed-down simulation stretches
# them by the same factor, so that they mean the same in the device's time.
TIMEOUTS_S = {"HALFMOON_REQUEST_TIMEOUT_S": 60.0, "HALFMOON_KV_WAIT_TIMEOUT_S": 10.0}


def scaled_timeouts(time_scale: float) -> dict[str, str]:
    return {name: str(seconds * time_scale) for name, seconds in TIMEOUTS_S.items()}


def at_load(requests: list[BenchRequest], load: float, time_scale: float
            ) -> list[BenchRequest]:
    """`load` times the arrival rate, in wall time."""
    return [replace(r, arrival_s=(r.arrival_s or 0.0) / load * time_scale) for r in requests]


def in_device_time(record: RequestRecord, time_scale: float) -> RequestRecord:
    return replace(record, sent_at_s=record.sent_at_s / time_scale,
                   chunk_times_s=[t / time_scale for t in record.chunk_times_s],
                   end_s=record.end_s / time_scale)


async def measure(url: str, nats_url: str, requests: list[BenchRequest], slo: Slo,
                  time_scale: float, num_workers: int) -> Run:
    """One run (its setup and load filled in by the caller)."""
    probe = UtilizationProbe(nats_url)
    await probe.start()
    try:
        await probe.wait_for_workers(num_workers)
        start, started_at = probe.snapshot(), time.monotonic()
        migrated_before = probe.num_migrated
        summary, records = await benchmark(url, requests, slo, progress=True)
        utilization = await probe.since(start)
        num_migrated = probe.num_migrated - migrated_before
    finally:
        await probe.close()
    scaled = [in_device_time(r, time_scale) for r in records]
    def device_time(changes: list[tuple[float, str, str]]) -> list[tuple[float, str, str]]:
        return [(max(0.0, at - started_at) / time_scale, worker_id, value)
                for at, worker_id, value in changes]

    return Run("", 0.0, summarize(scaled, summary.duration_s / time_scale, slo), scaled,
               utilization, device_time(probe.roles), device_time(probe.models), num_migrated)


def run_one(args: argparse.Namespace, setup: str, load: float,
            requests: list[BenchRequest], slo: Slo) -> Run:
    time_scale = args.time_scale if args.engine == "sim" else 1.0
    nats_port = free_port()
    with launched(*cluster_args(args, setup), "--nats-port", str(nats_port),
                  env=scaled_timeouts(time_scale)) as (_, url):
        run = asyncio.run(measure(
            url, f"nats://127.0.0.1:{nats_port}", at_load(requests, load, time_scale), slo,
            time_scale, args.workers))
    return replace(run, setup=setup, load=load)


def in_turns(setups: Sequence[str], repeat: int) -> list[str]:
    """Each setup `repeat` times, in turns: first to last, then last to first, so that drift
    over the whole run falls on every setup alike."""
    return [setup for turn in range(repeat)
            for setup in (setups if turn % 2 == 0 else setups[::-1])]


def run_row(run: Run) -> str:
    s = run.summary
    return (f"{run.setup:>13} {run.load:5.2f} {s.num_ok:5d} {s.num_rejected + s.num_errors:4d} "
            f"{s.ttft.p50:9.1f} {s.ttft.p99:9.1f} {s.itl.p50:8.1f} {s.itl.p99:8.1f} "
            f"{s.output_tokens_per_s:8.1f} {s.goodput_requests_per_s:7.2f} "
            f"{100 * s.slo_attainment:5.1f} {100 * run.mean_utilization:5.1f}")


RUN_HEADER = (f"{'setup':>13} {'load':>5} {'ok':>5} {'fail':>4} {'TTFT p50':>9} {'p99':>9} "
              f"{'ITL p50':>8} {'p99':>8} {'tok/s':>8} {'goodput':>7} {'SLO%':>5} "
              f"{'util%':>5}")


def reference_load(runs: list[Run]) -> float:
    """The highest load at which both setups meet the SLO for 90 % of requests (else the
    lowest load): where both still serve, so that their tails compare like for like."""
    loads = sorted({r.load for r in runs})
    meeting = [load for load in loads
               if all(r.summary.slo_attainment >= ATTAINMENT_TARGET
                      for r in runs if r.load == load)]
    return max(meeting) if meeting else loads[0]


def best_goodput(runs: list[Run], setup: str) -> Run:
    return max((r for r in runs if r.setup == setup),
               key=lambda r: r.summary.goodput_requests_per_s)


def ratio_table(runs: list[Run]) -> str:
    """The seed's table: the tails at every load, throughput at the SLO (best goodput over
    the loads) and utilization at that load; ratios colocated over disaggregated for
    latencies, disaggregated over colocated for the rest."""
    def row(name: str, a: float, b: float, ratio: float, seed: str) -> str:
        return f"{name:<36} {a:>11.2f} {b:>13.2f} {ratio:>8.2f}x {seed:>12}"

    lines = [f"{'metric':<36} {'colocated':>11} {'disaggregated':>13} {'ratio':>9} "
             f"{'seed claims':>12}"]
    for name, seed in (("ttft", "5.3x"), ("itl", "2.7x")):
        for load in sorted({r.load for r in runs}):
            col, dis = (next(r for r in runs if r.setup == s and r.load == load)
                        for s in SETUPS)
            a, b = getattr(col.summary, name).p99, getattr(dis.summary, name).p99
            lines.append(row(f"{name.upper()} p99 ms, load {load:g} (lower)", a, b, a / b, seed))
    best_col, best_dis = best_goodput(runs, "colocated"), best_goodput(runs, "disaggregated")
    a, b = best_col.summary.goodput_requests_per_s, best_dis.summary.goodput_requests_per_s
    lines.append(row("throughput at SLO, goodput req/s", a, b, b / max(1e-9, a), "1.8x"))
    a, b = best_col.mean_utilization, best_dis.mean_utilization
    lines.append(row(f"utilization % there (loads {best_col.load:g}, {best_dis.load:g})",
                     100 * a, 100 * b, b / max(1e-9, a), "45 -> 75 %"))
    return "\n".join(lines)


def write_outputs(out: Path, runs: list[Run], settings: dict[str, object]) -> list[Path]:
    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    data = [{"setup": r.setup, "load": r.load, "summary": r.summary.to_dict(),
             "mean_utilization": r.mean_utilization,
             "utilization": [asdict(w) for w in r.utilization]} for r in runs]
    result = out / "compare.json"
    result.write_text(json.dumps({"settings": settings, "runs": data}, indent=1, default=str))
    load = reference_load(runs)
    at_reference = [(r.setup, r.records) for r in runs if r.load == load]
    return [result,
            plots.latency_cdfs(at_reference, out / "compare_latency_cdf.png",
                               title=f"load {load:g}"),
            plots.goodput_and_utilization(
                [(s, [(r.load, r.summary.goodput_requests_per_s, r.mean_utilization)
                      for r in runs if r.setup == s]) for s in SETUPS],
                out / "compare_goodput.png")]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon bench compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["sim", "torch"], default="sim")
    parser.add_argument("--sim-profile", default="llama-3-8b-h200")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="sim: wall seconds per simulated second")
    parser.add_argument("--workers", type=int, default=8, help="workers in each setup")
    parser.add_argument("--prefill", type=int, default=None,
                        help="disaggregated: prefill workers (default: half)")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--loads", default="1", help="load factors, e.g. 0.5,1,1.5")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--concurrency", type=int, default=None, help=argparse.SUPPRESS)
    add_workload_flags(parser)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--planner", action="store_true",
                        help="also run the planner (--planner slo, starting at the --prefill "
                             "split) against every static split (see --splits)")
    parser.add_argument("--splits", default=None,
                        help="with --planner: the static splits' prefill counts, e.g. 2,4,6 "
                             "(default: every one, 1 .. workers - 1)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="with --planner: run every setup this many times, in turns, "
                             "and compare mean goodputs")
    parser.add_argument("--models", default=None,
                        help="sim: serve these profiles (comma-separated), the workers split "
                             "evenly between them (give each phase its model: --phase "
                             "IN:OUT:NUM:MODEL); with --planner: a fixed split against the "
                             "planner, which may also move workers between models")
    parser.add_argument("--sim-load-bytes-per-s", type=float, default=25e9,
                        help="with --models: the rate a worker loads another model's weights")
    parser.add_argument("--planner-hold-s", type=float, default=0.25,
                        help="with --planner: planner_hold_s in the device's time")
    parser.add_argument("--planner-cooldown-s", type=float, default=0.5,
                        help="with --planner: planner_cooldown_s in the device's time")
    parser.add_argument("--planner-home-after-s", type=float, default=10.0,
                        help="with --planner: planner_home_after_s in the device's time")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.prefill = args.prefill if args.prefill is not None else args.workers // 2
    if not 0 < args.prefill < args.workers:
        raise SystemExit("--prefill must leave at least one decode worker")
    if args.trace is None and args.rate is None:
        raise SystemExit("give --rate (requests/s at load 1) or --trace")
    requests = build_workload(args)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    setups = planner_compare.planner_setups(args) if args.planner else args.setups.split(",")
    if args.repeat < 1 or (args.repeat > 1 and not args.planner):
        raise SystemExit("--repeat: how many runs of each setup (1 or more), with --planner")
    runs = []
    for load in (float(x) for x in args.loads.split(",")):
        for setup in in_turns(setups, args.repeat):
            runs.append(run_one(args, setup, load, requests, slo))
            print(f"{RUN_HEADER}\n{run_row(runs[-1])}", file=sys.stderr, flush=True)
    print(RUN_HEADER)
    for run in runs:
        print(run_row(run))
    if {r.setup for r in runs} == set(SETUPS):
        print()
        print(ratio_table(runs))
    if args.planner:
        print()
        print(planner_compare.goodput_table(runs))
    if args.out is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        paths = (planner_compare.write_outputs(args.out, runs, args, requests) if args.planner
                 else write_outputs(args.out, runs, settings))
        for path in paths:
            print(f"wrote {path}")
    return 0
