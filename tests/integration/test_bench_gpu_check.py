"""`python -m bench.gpu_check`, the script prepared for a CUDA machine, run here on the CPU
with a small decode model: every section passes and the report is written."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.gpu_check import main

pytestmark = pytest.mark.e2e


async def test_the_gpu_check_runs_every_section_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--device", "cpu", "--hidden", "128", "--layers", "2", "--out", str(out)]
    assert await asyncio.to_thread(main, argv) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["logits"]["logits_ok"] and report["logits"]["greedy_32_equal"]
    assert report["decode"]["batch_32"]["halfmoon_tok_s"] > 0
    assert report["serving"]["disaggregated_tcp_equals_colocated"]
    assert report["kv_transfer"]["equal"] and report["kv_transfer"]["gb_per_s"] > 0
