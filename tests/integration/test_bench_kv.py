"""The KV benchmarks, small: `bench.kv_compression` (quantized KV's bytes and quality) and
`bench.kv_memory` (growth with preemption against up-front reservation)."""

from __future__ import annotations

import asyncio

import pytest

from bench import kv_compression, kv_memory

pytestmark = pytest.mark.e2e


async def test_the_compression_benchmark_measures_each_scheme(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", "builtin", "--prompts", "6", "--tokens", "6"]
    assert await asyncio.to_thread(kv_compression.main, argv) == 0
    rows = {line.split()[2]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("built-in")}
    assert set(rows) == {"none", "fp8", "int8"}
    assert rows["none"][4] == "1.00x" and rows["none"][-1] == "0.0000"
    for scheme in ("fp8", "int8"):  # fp32 KV: a quarter of the bytes, and some error
        assert 3.9 < float(rows[scheme][4].rstrip("x")) < 4.0
        assert float(rows[scheme][-1]) > 0


async def test_the_memory_benchmark_runs_more_requests_at_once_by_growing(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--requests", "12", "--num-blocks", "48", "--output", "32", "--rounds", "1"]
    assert await asyncio.to_thread(kv_memory.main, argv) == 0
    out = capsys.readouterr().out
    ratio = out.split("concurrent requests ")[1].split("x")[0]
    assert float(ratio) > 1.0, out
