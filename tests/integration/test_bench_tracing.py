"""The tracing benchmarks run end to end, small: both stacks (fresh per window, or live),
the collector, the summary; and the one-process cost of each part of tracing."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("flags", "modes"), [
    ([], ("off", "on")),
    (["--live", "--rounds", "2"], ("off", "on")),
    (["--against-sdk"], ("sdk", "lean")),
])
def test_tracing_overhead_prints_both_modes_and_their_ratio(flags: list[str],
                                                            modes: tuple[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.tracing_overhead", "--rounds", "1", "--duration-s", "1",
         "--concurrency", "2", "--max-tokens", "4", *flags],
        capture_output=True, text=True, timeout=110, check=True)
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in modes and line.endswith("ms")}
    baseline, measured = modes
    assert float(rows[baseline][-4]) > 0 and float(rows[measured][-4]) > 0  # req/s of each
    assert re.search(r"throughput \d\.\d{3}x \(median of pairs \d\.\d{3}x\)", done.stdout)
    cpu = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()
           if line.split() and line.split()[0] in ("gateway", "decode", "stack", "collector")}
    assert set(cpu) == {"gateway", "decode", "stack", "collector"}  # each mode and delta
    assert float(cpu["stack"][0]) > float(cpu["gateway"][0]) > 0
    assert float(cpu["collector"][1]) >= 0


@pytest.mark.parametrize("variant", ["on", "drop", "ratio0", "header", "noheader"])
def test_tracing_cost_prints_each_windows_cpu_and_the_difference(variant: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.tracing_cost", "--variant", variant, "--rounds", "2",
         "--requests", "10", "--concurrency", "2", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=110, check=True)
    windows = {line.split()[0]: [float(v) for v in line.split(":")[1].split()]
               for line in done.stdout.splitlines() if "by window:" in line}
    assert set(windows) == {"off", variant}
    assert all(len(values) == 2 and min(values) > 0 for values in windows.values())
    assert re.search(rf"^{variant} - off: [+-]\d+ us per request on \d+ \(\d\.\d{{3}}x\)",
                     done.stdout, re.MULTILINE)


def test_tracing_calls_counts_what_each_tracing_call_site_adds() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.tracing_calls", "--requests", "10", "--concurrency", "2",
         "--max-tokens", "4"],
        capture_output=True, text=True, timeout=110, check=True)
    totals = re.search(r"^calls per request: off (\d+), on (\d+)", done.stdout, re.MULTILINE)
    assert totals is not None and int(totals[2]) > int(totals[1]) > 0
    # The gateway's root span is among what tracing adds, named by the line that makes it.
    root = re.search(r"^\s+\+(\d+\.\d) +span <- services/gateway/api\.py:\d+$", done.stdout,
                     re.MULTILINE)
    assert root is not None and float(root[1]) > 0
