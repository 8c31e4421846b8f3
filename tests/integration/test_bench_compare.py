"""`halfmoon bench compare` end to end: two real clusters of simulated workers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.compare import main

pytestmark = pytest.mark.e2e


async def test_compare_runs_both_setups_and_writes_the_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", "sim", "--workers", "2", "--prefill", "1", "--time-scale", "1",
            "--rate", "20", "--num-requests", "12", "--input-len", "1024",
            "--output-len", "16", "--slo-ttft-ms", "5000", "--slo-itl-ms", "500",
            "--out", str(tmp_path)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "TTFT p99 ms, load 1" in out and "throughput at SLO" in out
    runs = json.loads((tmp_path / "compare.json").read_text())["runs"]
    assert [(r["setup"], r["summary"]["num_ok"]) for r in runs] == [
        ("colocated", 12), ("disaggregated", 12)]
    for r in runs:
        roles = sorted(u["role"] for u in r["utilization"])
        assert roles == (["decode", "decode"] if r["setup"] == "colocated"
                         else ["decode", "prefill"])
        assert all(0 < u["utilization"] <= 1 for u in r["utilization"])
    for name in ("compare_latency_cdf.png", "compare_goodput.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


async def test_compare_with_the_planner_runs_every_setup_and_plots_the_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--engine", "sim", "--workers", "3", "--prefill", "1", "--planner",
            "--splits", "2", "--time-scale", "2", "--rate", "20",
            "--phase", "1024:8:10", "--phase", "64:32:10",
            "--slo-ttft-ms", "5000", "--slo-itl-ms", "500", "--out", str(tmp_path)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "planner goodput" in out and "the best static split (2+1" in out
    runs = json.loads((tmp_path / "planner.json").read_text())["runs"]
    assert [(r["setup"], r["repeat"], r["summary"]["num_ok"]) for r in runs] == [
        ("colocated", 0, 20), ("2+1", 0, 20), ("planner", 0, 20)]
    assert [r["num_migrated"] for r in runs[:-1]] == [0, 0]  # no stream moved, none lost
    planner = runs[-1]
    assert planner["split_over_time"][-1][1] >= 1  # prefill workers at the end, at least one
    assert (tmp_path / "planner_split_load1.png").read_bytes()[:4] == b"\x89PNG"
