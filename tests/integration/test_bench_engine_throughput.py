"""`python -m bench.engine_throughput` on a small model: every workload measured for ours,
the before engine and transformers, over several rounds."""

from __future__ import annotations

import asyncio
import re

import pytest

from bench.engine_throughput import main

pytestmark = pytest.mark.e2e


async def test_the_engine_bench_reports_medians_of_its_rounds(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--hidden", "128", "--layers", "2", "--prompts", "32", "--batches", "1,2",
            "--decode-tokens", "3", "--rounds", "2", "--dtype", "float32"]
    await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert "the median of 2 rounds" in out
    rows = re.findall(r"^(prefill \d+ tok|decode batch \d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                      r"\s+([\d.]+)x\s+([\d.]+)x$", out, flags=re.MULTILINE)
    assert [row[0] for row in rows] == ["prefill 32 tok", "decode batch 1", "decode batch 2"]
    for _, ours, before, theirs, vs_theirs, vs_before in rows:
        assert min(float(ours), float(before), float(theirs)) > 0
        assert float(vs_theirs) == pytest.approx(float(ours) / float(theirs), abs=0.01)
        assert float(vs_before) == pytest.approx(float(ours) / float(before), abs=0.01)
