"""`halfmoon bench compare --planner`: the planner against every static split, same workers,
same seeded load, in one run (`--repeat N`: N runs of each).

    halfmoon bench compare --engine sim --workers 8 --prefill 4 --planner --time-scale 20 \\
        --rate 40 --phase 2048:32:200 --phase 256:512:200 --range-ratio 0.5 \\
        --slo-ttft-ms 2000 --slo-itl-ms 100 --out planner/

Setups: colocated, every static split `P+D` of `--workers` (or `--splits`), and `planner`:
`--prefill` + the rest to start with, `--planner slo` moving workers between the roles. Every
setup's conductor gets the same SLOs (`--ttft-slo-ms`, `--tbt-slo-ms`: the bench's, in wall
time), so admission is alike and only the planner differs. The planner's hold, cooldown and
calm before homecoming are given in the device's time (`--planner-hold-s`,
`--planner-cooldown-s`, `--planner-home-after-s`) and stretched by the time scale, as every
other time is. Prints each setup's goodput and the planner's against the best static split
and colocated. With `--repeat N` every setup runs N times, in turns (first to last, then last
to first), and setups compare by their mean goodput: the best static split is then the one
best on average, not the luckiest of several single runs (a maximum of noisy figures is
biased upwards, against the planner). With `--out`: `planner.json`, the split over time
(`planner_split.png`) and the latency CDFs of the planner against the best static split (of
each setup's first run).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from bench.workload import BenchRequest

if TYPE_CHECKING:
    from bench.compare import Run

T = TypeVar("T")

PLANNER = "planner"


def planner_setups(args: argparse.Namespace) -> list[str]:
    if args.slo_ttft_ms is None and args.slo_itl_ms is None:
        raise SystemExit("--planner plans against the SLOs: give --slo-ttft-ms and/or "
                         "--slo-itl-ms")
    default = [args.prefill] if args.models else range(1, args.workers)
    splits = [int(p) for p in args.splits.split(",")] if args.splits else default
    if any(not 0 < p < args.workers for p in splits):
        raise SystemExit(f"--splits: each split needs a prefill and a decode worker of "
                         f"{args.workers}")
    colocated = [] if args.models else ["colocated"]  # models: the fixed split alone
    return [*colocated, *(f"{p}+{args.workers - p}" for p in splits), PLANNER]


def conductor_flags(args: argparse.Namespace, setup: str) -> list[str]:
    """The SLOs for every setup's conductor (admission alike), the planner for one."""
    scale = args.time_scale if args.engine == "sim" else 1.0
    flags = []
    if args.slo_ttft_ms is not None:
        flags += ["--ttft-slo-ms", str(args.slo_ttft_ms * scale)]
    if args.slo_itl_ms is not None:
        flags += ["--tbt-slo-ms", str(args.slo_itl_ms * scale)]
    if setup == PLANNER:
        flags += ["--planner", "slo", "--planner-interval-s", str(max(0.2, 0.05 * scale)),
                  "--planner-hold-s", str(args.planner_hold_s * scale),
                  "--planner-cooldown-s", str(args.planner_cooldown_s * scale),
                  "--planner-home-after-s", str(args.planner_home_after_s * scale)]
    return flags


def goodput_table(runs: list[Run]) -> str:
    lines = [f"{'setup':>10} {'load':>5} {'ok':>5} {'fail':>5} {'goodput':>8} {'SLO met':>8} "
             f"{'TTFT p99':>9} {'ITL p99':>8} {'moved':>6}"]
    for run in runs:
        s = run.summary
        lines.append(f"{run.setup:>10} {run.load:5.2f} {s.num_ok:5d} "
                     f"{s.num_rejected + s.num_errors:5d} {s.goodput_requests_per_s:8.2f} "
                     f"{100 * s.slo_attainment:7.1f}% {s.ttft.p99:9.1f} {s.itl.p99:8.1f} "
                     f"{run.num_migrated:6d}")
    for load in sorted({r.load for r in runs}):
        planner, best, colocated = _contenders(runs, load)
        if not planner or not best:
            continue
        goodput = mean_goodput(planner)
        line = (f"load {load:g}: planner goodput {_goodputs(planner)} req/s = "
                f"{goodput / max(1e-9, mean_goodput(best)):.2f}x the best static split "
                f"({best[0].setup}: {_goodputs(best)})")
        if colocated:
            line += (f", {goodput / max(1e-9, mean_goodput(colocated)):.2f}x colocated "
                     f"({_goodputs(colocated)})")
        if len(planner) == len(best) > 1:
            line += "; run by run: " + ", ".join(
                f"{mean_goodput([p]) / max(1e-9, mean_goodput([b])):.2f}x"
                for p, b in zip(planner, best, strict=True))
        lines.append(line)
    return "\n".join(lines)


def mean_goodput(runs: list[Run]) -> float:
    return sum(r.summary.goodput_requests_per_s for r in runs) / len(runs)


def _goodputs(runs: list[Run]) -> str:
    """One run's goodput, or the mean of several and each."""
    if len(runs) == 1:
        return f"{mean_goodput(runs):.2f}"
    return (f"{mean_goodput(runs):.2f}, the mean of "
            + " ".join(f"{r.summary.goodput_requests_per_s:.2f}" for r in runs))


def _contenders(runs: list[Run], load: float) -> tuple[list[Run], list[Run], list[Run]]:
    """At `load`: the planner's runs, those of the static split best on average (with
    `--repeat`, not the one luckiest run), colocated's; each setup's in the order run."""
    by_setup: dict[str, list[Run]] = {}
    for run in runs:
        if run.load == load:
            by_setup.setdefault(run.setup, []).append(run)
    static = [setup_runs for setup, setup_runs in by_setup.items() if "+" in setup]
    return (by_setup.get(PLANNER, []), max(static, key=mean_goodput, default=[]),
            by_setup.get("colocated", []))


def split_over_time(run: Run) -> list[tuple[float, int]]:
    """(device seconds, prefill workers) at each change of the planner run's split, and at
    the run's end (the split it ended with)."""
    roles: dict[str, str] = {}
    points = []
    for at_s, worker_id, role in sorted(run.roles):
        roles[worker_id] = role
        points.append((at_s, sum(r == "prefill" for r in roles.values())))
    return _settled(points, run.summary.duration_s)


def models_over_time(run: Run) -> list[tuple[float, dict[str, int]]]:
    """(device seconds, workers per model) at each change of a worker's model, and at the
    run's end."""
    models: dict[str, str] = {}
    points = []
    for at_s, worker_id, model in sorted(run.models):
        models[worker_id] = model
        points.append((at_s, dict(Counter(models.values()))))
    return _settled(points, run.summary.duration_s)


def _settled(points: list[tuple[float, T]], end_s: float) -> list[tuple[float, T]]:
    """The last point at each time (workers seen at one instant, as at the start, count
    together, not one by one), and the last again at the run's end."""
    settled = [point for point, after in zip(points, [*points[1:], None], strict=True)
               if after is None or after[0] != point[0]]
    if settled:
        settled.append((max(settled[-1][0], end_s), settled[-1][1]))
    return settled


def phase_starts(args: argparse.Namespace, load: float) -> list[float]:
    """Device seconds at which each phase after the first begins."""
    if not args.phases or args.rate is None:
        return []
    starts, at = [], 0.0
    for phase in args.phases[:-1]:
        at += phase.num_requests / args.rate / load
        starts.append(at)
    return starts


def write_outputs(out: Path, runs: list[Run], args: argparse.Namespace,
                  requests: list[BenchRequest]) -> list[Path]:
    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    seen: Counter[tuple[str, float]] = Counter()
    repeats: dict[int, int] = {}  # a run's place among its setup's runs at its load
    for run in runs:
        repeats[id(run)] = seen[run.setup, run.load]
        seen[run.setup, run.load] += 1
    written = [out / "planner.json"]
    written[0].write_text(json.dumps({
        "settings": {k: str(v) for k, v in vars(args).items()},
        "num_requests": len(requests),
        "runs": [{"setup": r.setup, "load": r.load, "repeat": repeats[id(r)],
                  "summary": r.summary.to_dict(),
                  "mean_utilization": r.mean_utilization,
                  "utilization": [asdict(w) for w in r.utilization],
                  "num_migrated": r.num_migrated,
                  "split_over_time": split_over_time(r),
                  "models_over_time": models_over_time(r)} for r in runs]}, indent=1))
    for load in sorted({r.load for r in runs}):
        planner_runs, best_runs, _ = _contenders(runs, load)
        if not planner_runs:
            continue
        planner = planner_runs[0]  # the plots show each setup's first run
        written.append(plots.split_over_time(
            split_over_time(planner), args.workers, out / f"planner_split_load{load:g}.png",
            phase_starts=phase_starts(args, load), title=f"planner, load {load:g}"))
        if args.models:
            written.append(plots.models_over_time(
                models_over_time(planner), args.workers,
                out / f"planner_models_load{load:g}.png",
                phase_starts=phase_starts(args, load), title=f"planner, load {load:g}"))
        if best_runs:
            best = best_runs[0]
            written.append(plots.latency_cdfs(
                [(PLANNER, planner.records), (best.setup, best.records)],
                out / f"planner_latency_cdf_load{load:g}.png", title=f"load {load:g}"))
    return written
