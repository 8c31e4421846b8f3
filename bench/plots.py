"""PNG plots of benchmark runs (matplotlib, headless): latency CDFs and throughput over time.

Every function takes one or more labelled runs, so a single run and a comparison of setups
draw the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.client import RequestRecord

Runs = Sequence[tuple[str, list[RequestRecord]]]


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("plots need matplotlib: pip install 'halfmoon[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, figure, path: Path, title: str) -> Path:  # type: ignore[no-untyped-def]
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _decorate(axes, grid_which: str = "major") -> None:  # type: ignore[no-untyped-def]
    axes.grid(True, which=grid_which, alpha=0.3)
    axes.legend()


def _cdf(axes, values_ms: list[float], label: str) -> None:  # type: ignore[no-untyped-def]
    ordered = sorted(values_ms)
    if ordered:
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.plot(ordered, fractions, label=label)


def latency_cdfs(runs: Runs, path: Path, title: str = "") -> Path:
    """TTFT and ITL CDFs side by side (log-scaled time)."""
    plt = _pyplot()
    figure, (ttft_axes, itl_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for label, records in runs:
        ok = [r for r in records if r.status == "ok"]
        _cdf(ttft_axes, [1000 * r.ttft_s for r in ok], label)
        _cdf(itl_axes, [1000 * itl for r in ok for itl in r.itls_s], label)
    for axes, name in ((ttft_axes, "TTFT"), (itl_axes, "inter-token latency")):
        axes.set_xscale("log")
        axes.set_xlabel(f"{name} (ms)")
        axes.set_ylabel("fraction of " + ("requests" if name == "TTFT" else "tokens"))
        _decorate(axes, grid_which="both")
    return _save(plt, figure, path, title)


def throughput_over_time(runs: Runs, path: Path, bin_s: float = 1.0, title: str = "") -> Path:
    """Output tokens per second, counted when each token arrived, in `bin_s` bins."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 4))
    for label, records in runs:
        stamps = [r.sent_at_s + t for r in records if r.status == "ok" for t in r.chunk_times_s]
        if not stamps:
            continue
        counts = [0] * (int(max(stamps) / bin_s) + 1)
        for stamp in stamps:
            counts[int(stamp / bin_s)] += 1
        axes.plot([i * bin_s for i in range(len(counts))], [c / bin_s for c in counts],
                  label=label)
    axes.set_xlabel("time from start (s)")
    axes.set_ylabel("output tokens/s")
    _decorate(axes)
    return _save(plt, figure, path, title)


def goodput_and_utilization(series: Sequence[tuple[str, list[tuple[float, float, float]]]],
                            path: Path, title: str = "") -> Path:
    """Per setup, over load factors: goodput (req/s within the SLO) and mean utilization."""
    plt = _pyplot()
    figure, (goodput_axes, util_axes) = plt.subplots(1, 2, figsize=(11, 4))
    for label, points in series:
        points = sorted(points)
        loads = [p[0] for p in points]
        goodput_axes.plot(loads, [p[1] for p in points], marker="o", label=label)
        util_axes.plot(loads, [100 * p[2] for p in points], marker="o", label=label)
    goodput_axes.set_ylabel("goodput (requests/s within SLO)")
    util_axes.set_ylabel("accelerator utilization (%)")
    for axes in (goodput_axes, util_axes):
        axes.set_xlabel("load factor")
        _decorate(axes)
    return _save(plt, figure, path, title)


def split_over_time(points: Sequence[tuple[float, int]], num_workers: int, path: Path, *,
                    phase_starts: Sequence[float] = (), title: str = "") -> Path:
    """Prefill and decode workers over time (a step plot), with the workload's phase
    changes marked."""
    prefill = [n for _, n in points]
    return _workers_over_time(
        [at for at, _ in points],
        {"prefill workers": prefill, "decode workers": [num_workers - n for n in prefill]},
        num_workers, path, phase_starts, title)


def models_over_time(points: Sequence[tuple[float, dict[str, int]]], num_workers: int,
                     path: Path, *, phase_starts: Sequence[float] = (), title: str = "") -> Path:
    """Workers serving each model over time (a step plot), with the phase changes marked."""
    models = sorted({m for _, counts in points for m in counts})
    return _workers_over_time(
        [at for at, _ in points],
        {f"{m} workers": [counts.get(m, 0) for _, counts in points] for m in models},
        num_workers, path, phase_starts, title)


def _workers_over_time(times: list[float], lines: dict[str, list[int]], num_workers: int,
                       path: Path, phase_starts: Sequence[float], title: str) -> Path:
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(11, 4))
    for label, counts in lines.items():
        axes.step(times, counts, where="post", label=label)
    for index, start in enumerate(phase_starts):
        axes.axvline(start, color="grey", linestyle="--",
                     label="phase change" if index == 0 else None)
    axes.set_xlabel("time from start (device s)")
    axes.set_ylabel("workers")
    axes.set_ylim(0, num_workers)
    _decorate(axes)
    return _save(plt, figure, path, title)
