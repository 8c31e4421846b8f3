"""The tracing benchmark runs end to end, small: both stacks (fresh per window, or live),
the collector, the summary."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("flags", [[], ["--live", "--rounds", "2"]])
def test_tracing_overhead_prints_both_modes_and_their_ratio(flags: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.tracing_overhead", "--rounds", "1", "--duration-s", "1",
         "--concurrency", "2", "--max-tokens", "4", *flags],
        capture_output=True, text=True, timeout=110, check=True)
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()
            if line.split() and line.split()[0] in ("off", "on")}
    assert float(rows["off"][1]) > 0 and float(rows["on"][3]) > 0  # req/s of each mode
    assert re.search(r"throughput \d\.\d{3}x \(median of pairs \d\.\d{3}x\)", done.stdout)
