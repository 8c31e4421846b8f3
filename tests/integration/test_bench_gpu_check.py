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
    assert report["decode"]["batch_32"]["graphs_tokens_equal"]
    serving = report["serving"]
    assert serving["disaggregated_tcp_equals_colocated"]
    assert serving["disaggregated_cuda_ipc_equals_colocated"]
    assert serving["disaggregated_shm_mirror_equals_colocated"]
    # No GPU: the cuda transport is not opened and the KV goes over TCP; CPU pools are
    # shared memory themselves, so shm reaches them.
    assert serving["kv_transports_seen"] == {"disaggregated_tcp": ["tcp"],
                                             "disaggregated_cuda_ipc": ["tcp"],
                                             "disaggregated_shm_mirror": ["shm"]}
    # CPU tensors are registered as they are (no mirror): shm cannot reach them, tcp does.
    for name in ("tcp", "cuda_ipc", "shm_mirror"):
        row = report["kv_transfer"][name]
        assert (row["transport"], row["equal"]) == ("tcp", True) and row["gb_per_s"] > 0
    assert "skipped" in report["gpu_tests"]["summary"]  # no CUDA device here
