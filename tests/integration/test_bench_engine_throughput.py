"""`python -m bench.engine_throughput` on a small model: every workload measured for ours,
the before engine and transformers, over several rounds, each in a process of its own (the
default) or all in one (`--in-process`); a party that fails says why."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import torch

from bench.engine_processes import PartyFailed, PartyProcess
from bench.engine_throughput import main

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(("flags", "where"), [
    (["--in-process"], "all in this process"),
    ([], "each in a process of its own"),
    (["--isolated"], "each in a process of its own"),
])
async def test_the_engine_bench_reports_medians_of_its_rounds(
        flags: list[str], where: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--hidden", "128", "--layers", "2", "--prompts", "32", "--batches", "1,2",
            "--decode-tokens", "3", "--rounds", "2", "--dtype", "float32", *flags]
    await asyncio.to_thread(main, argv)
    out = capsys.readouterr().out
    assert where in out and "the median of 2 rounds" in out
    rows = re.findall(r"^(prefill \d+ tok|decode batch \d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                      r"\s+([\d.]+)x\s+([\d.]+)x$", out, flags=re.MULTILINE)
    assert [row[0] for row in rows] == ["prefill 32 tok", "decode batch 1", "decode batch 2"]
    for _, ours, before, theirs, vs_theirs, vs_before in rows:
        assert min(float(ours), float(before), float(theirs)) > 0
        assert float(vs_theirs) == pytest.approx(float(ours) / float(theirs), abs=0.01)
        assert float(vs_before) == pytest.approx(float(ours) / float(before), abs=0.01)


def test_a_party_that_fails_to_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(PartyFailed, match=r"halfmoon: Traceback"):
        PartyProcess("halfmoon", tmp_path / "missing", torch.float32, {})
