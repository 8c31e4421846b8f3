"""What tracing costs: the control-path benchmark with tracing off and at 100 % sampling.

Starts a rotel collector (a real OTLP/gRPC receiver, its own process, dropping what it
receives), then, in `--rounds` rounds, `halfmoon up --engine fake` once with tracing off and
once with every service exporting every span to the collector (`--tracing otlp-grpc`,
`--trace-sample-ratio`, 1 by default), in the order ABBA so drift falls on both alike; each
stack is warmed up, then driven by `--concurrency` streaming clients for `--duration-s`.
Prints requests/s and TTFT per mode, the traced/untraced ratios of the means and the median
of the per-round throughput ratios (robust to one slow spell), and each process's CPU per
request in each mode (`/proc`, main thread and other threads apart: `bench.process_cpu`),
the collector's included: it shares this machine's cores with the stack, where a deployment
would run it elsewhere, so its CPU is a cost of this bench more than of tracing.
This machine is shared and noisy, and a stack that runs slower also coalesces fewer tokens
per message, so one window can be 10-20 % off the next: `--control` runs tracing off against
tracing off, the same way, to show the noise floor of the ratio; `--against-sdk` runs both
stacks traced, the SDK's tracer (`--tracer sdk`, the baseline) against the lean one.
`--live` starts each stack once and keeps both up, measuring them in turn in short windows
(drift then falls on both within seconds, and no window pays for a stack's start): use many
rounds.

    python -m bench.tracing_overhead --rounds 6 --duration-s 6 [--control]
    python -m bench.tracing_overhead --live --rounds 30 --duration-s 2 [--control | --against-sdk]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import rotel

from bench.control_path import LevelResult, launched, run_level
from bench.process_cpu import process_cpu_s, stack_cpu_s
from shared.nats_server import free_port

ROTEL_AGENT = Path(rotel.__file__).parent / "rotel-agent"  # the collector's binary


def start_collector(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    grpc_port = free_port()
    process = subprocess.Popen(
        [str(ROTEL_AGENT), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{grpc_port}",
         "--otlp-http-endpoint", f"127.0.0.1:{free_port()}", "--exporter", "blackhole",
         "--pid-file", str(workdir / "rotel.pid"), "--log-file", str(workdir / "rotel.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, grpc_port


@dataclass(frozen=True)
class Window:
    result: LevelResult
    cpu_s: Counter[str]  # CPU seconds the stack's processes spent in the window, by role


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@contextlib.contextmanager
def stack(up_args: list[str], args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """`halfmoon up --engine fake` with these flags, warmed up; its URL and pid."""
    with launched("--engine", "fake", "--log-level", "warning", *up_args) as (process, url):
        asyncio.run(run_level(url, args.concurrency, 1.0, args.max_tokens))  # warm-up
        yield url, process.pid


def window(url: str, pid: int, args: argparse.Namespace) -> Window:
    before = _cpu_s(pid, args.collector_pid)
    result = asyncio.run(run_level(url, args.concurrency, args.duration_s, args.max_tokens))
    spent = _cpu_s(pid, args.collector_pid)
    spent.subtract(before)
    return Window(result, spent)


def _cpu_s(pid: int, collector_pid: int) -> Counter[str]:
    """CPU seconds so far of the stack under `pid` by role, and of the collector."""
    seconds = stack_cpu_s(pid)
    seconds["collector"] = process_cpu_s(collector_pid)
    return seconds


def measure(up_args: list[str], args: argparse.Namespace) -> Window:
    with stack(up_args, args) as (url, pid):
        return window(url, pid, args)


def run_rounds(modes: dict[str, list[str]], args: argparse.Namespace
               ) -> dict[str, list[Window]]:
    """`args.rounds` rounds, alternating which mode goes first: a fresh stack per mode
    and round, or (`--live`) one stack per mode, up throughout."""
    with contextlib.ExitStack() as stacks:
        take: dict[str, Callable[[], Window]]
        if args.live:
            up = {mode: stacks.enter_context(stack(flags, args)) for mode, flags in modes.items()}
            take = {mode: functools.partial(window, url, pid, args)
                    for mode, (url, pid) in up.items()}
        else:
            take = {mode: functools.partial(measure, flags, args)
                    for mode, flags in modes.items()}
        return _alternate(take, args.rounds)


def _alternate(take: dict[str, Callable[[], Window]], rounds: int
               ) -> dict[str, list[Window]]:
    results: dict[str, list[Window]] = {mode: [] for mode in take}
    for round_number in range(rounds):
        order = list(take) if round_number % 2 == 0 else list(reversed(take))
        for mode in order:
            taken = take[mode]()
            results[mode].append(taken)
            result = taken.result
            print(f"round {round_number + 1} tracing {mode}: {result.requests_per_s:.1f} "
                  f"req/s, TTFT p50 {result.ttft_p50_ms:.2f} ms", file=sys.stderr)
    return results


def print_summary(windows: dict[str, list[Window]]) -> None:
    results = {mode: [w.result for w in taken] for mode, taken in windows.items()}
    print(f"{'tracing':>11} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9}")
    summary = {}
    for mode, rounds in results.items():
        summary[mode] = (mean([r.requests_per_s for r in rounds]),
                         mean([r.ttft_p50_ms for r in rounds]),
                         mean([r.ttft_p99_ms for r in rounds]))
        print(f"{mode:>11} {summary[mode][0]:>8.1f} "
              f"{mean([r.tokens_per_s for r in rounds]):>9.0f} {summary[mode][1]:>7.2f}ms "
              f"{summary[mode][2]:>7.2f}ms")
    (off_rps, off_p50, off_p99), (on_rps, on_p50, on_p99) = summary.values()
    off_rounds, on_rounds = results.values()
    pair_median = statistics.median(
        on.requests_per_s / off.requests_per_s for off, on in zip(off_rounds, on_rounds,
                                                                   strict=True))
    baseline, measured = results
    print(f"{measured} / {baseline}: throughput {on_rps / off_rps:.3f}x (median of pairs "
          f"{pair_median:.3f}x), TTFT p50 {on_p50 / off_p50:.3f}x, TTFT p99 "
          f"{on_p99 / off_p99:.3f}x (throughput cost {100 * (1 - on_rps / off_rps):.1f} %)")
    print_cpu(windows)


def print_cpu(windows: dict[str, list[Window]]) -> None:
    """CPU per request of each process (and of its other threads), in each mode."""
    per_request: dict[str, dict[str, float]] = {}
    for mode, taken in windows.items():
        total: Counter[str] = Counter()
        for w in taken:
            total.update(w.cpu_s)
        num_requests = max(1, sum(w.result.num_requests for w in taken))
        per_request[mode] = {key: 1e6 * s / num_requests for key, s in total.items()}
    (baseline, off), (measured, on) = per_request.items()
    keys = sorted(k for k in off.keys() | on.keys()
                  if k != "collector" and max(off.get(k, 0), on.get(k, 0)) >= 1)
    print(f"CPU per request (us) {baseline:>12} {measured:>12} {'delta':>8}")
    for key in [*keys, "stack", "collector"]:
        a, b = (_stack_sum(cpu) if key == "stack" else cpu.get(key, 0.0) for cpu in (off, on))
        print(f"{key:<20} {a:>12.0f} {b:>12.0f} {b - a:>+8.0f}")


def _stack_sum(cpu: dict[str, float]) -> float:
    return sum(seconds for key, seconds in cpu.items() if key != "collector")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration-s", type=float, default=6.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-ratio", type=float, default=1.0)
    parser.add_argument("--control", action="store_true",
                        help="tracing off against tracing off: the ratio's noise floor")
    parser.add_argument("--live", action="store_true",
                        help="both stacks up throughout, measured in turn")
    parser.add_argument("--against-sdk", action="store_true",
                        help="both traced: the SDK's tracer (the baseline) against the lean one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        collector, grpc_port = start_collector(Path(workdir))
        args.collector_pid = collector.pid
        traced = ["--tracing", "otlp-grpc", "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}",
                  "--trace-sample-ratio", str(args.sample_ratio)]
        modes = {"off": ["--tracing", "off"],
                 "off again" if args.control else f"on ({100 * args.sample_ratio:g} %)":
                     ["--tracing", "off"] if args.control else traced}
        if args.against_sdk:
            modes = {"sdk tracer": [*traced, "--tracer", "sdk"], "lean tracer": traced}
        try:
            results = run_rounds(modes, args)
        finally:
            collector.terminate()
            collector.wait(timeout=10)
    print_summary(results)


if __name__ == "__main__":
    main()
