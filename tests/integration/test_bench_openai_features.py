"""`python -m bench.openai_features`, small: it runs, and an n=8 request prefills and moves
exactly one eighth of what 8 separate requests do (prefix caching off)."""

from __future__ import annotations

import asyncio

import pytest

from bench.openai_features import main

pytestmark = pytest.mark.e2e


async def test_the_feature_benchmark_runs_and_forks_for_an_eighth(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--models", "builtin", "--rounds", "1", "--batch", "2", "--max-tokens", "16"]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert "json_schema" in out and "logprobs 5" in out
    rows = {line.split()[0] + line.split()[1]: line.split()[-1] for line in out.splitlines()
            if line.strip().startswith(("prefill tokens", "KV bytes"))}
    assert rows == {"prefilltokens": "0.125x", "KVbytes": "0.125x"}
