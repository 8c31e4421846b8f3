"""`python -m bench.priority` runs end to end, small: its own `halfmoon up`, both modes in
turn, the table."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def test_priority_bench_prints_each_class_in_each_mode() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.priority", "--requests", "8", "--urgent-every", "4",
         "--rounds", "1", "--max-tokens", "16", "--max-batch-size", "2"],
        capture_output=True, text=True, timeout=120, check=True)
    rows = {(line.split()[0], line.split()[1]): line.split() for line in done.stdout.splitlines()
            if line.split()[:1] in (["urgent"], ["other"])}
    assert set(rows) == {(c, m) for c in ("urgent", "other") for m in ("priority", "baseline")}
    assert [rows[("urgent", m)][2] for m in ("priority", "baseline")] == ["2", "2"]
    assert [rows[("other", m)][2] for m in ("priority", "baseline")] == ["6", "6"]
    assert rows[("urgent", "baseline")][-1] == "1.00x"
