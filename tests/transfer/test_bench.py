"""The benchmark command runs end to end (two processes) and prints every row; its numbers
are for people, not for assertions."""

from __future__ import annotations

import subprocess
import sys


def test_bench_transfer_prints_every_shape_with_its_baselines() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "bench", "transfer", "--max-mib", "1",
         "--seconds", "0.01"], capture_output=True, text=True, timeout=120, check=True)
    lines = result.stdout.splitlines()
    assert lines[0].split("|")[1].split() == ["shm", "GB/s", "tcp", "GB/s"]
    shapes = [line.split("|")[0].strip() for line in lines[1:] if "|" in line]
    assert shapes == ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "1000 x 4 KiB",
                      "1000 x 64 KiB"]
    rows = {line.split("|")[0].strip(): line for line in lines[1:len(shapes) + 1]}
    for shape, line in rows.items():
        figures = [float(value) for value in line.split("|")[1].split()]
        # Tiny transfers may round to 0.00 GB/s on a loaded machine; 64 MiB never does.
        assert all(figure > 0 for figure in figures) or "KiB" in shape.split(" x ")[-1]
    assert all(float(v) > 0 for v in rows["1000 x 64 KiB"].split("|")[1].split())
    assert any(line.startswith("4 KiB: tcp round trip ") for line in lines)
