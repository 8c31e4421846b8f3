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
        assert_ratio(vs_theirs, ours, theirs)
        assert_ratio(vs_before, ours, before)


def assert_ratio(printed: str, numerator: str, denominator: str) -> None:
    """The printed ratio is of the unrounded figures; the figures are printed to 0.1 (so a
    small denominator moves the ratio recomputed from them by more than its own rounding)."""
    ratio = float(numerator) / float(denominator)
    slack = ratio * (0.05 / float(numerator) + 0.05 / float(denominator)) + 0.005
    assert float(printed) == pytest.approx(ratio, abs=slack)


def test_a_party_that_fails_to_start_says_why(tmp_path: Path) -> None:
    with pytest.raises(PartyFailed, match=r"halfmoon: Traceback"):
        PartyProcess("halfmoon", tmp_path / "missing", torch.float32, {})
