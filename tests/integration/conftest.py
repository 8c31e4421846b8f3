"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.builtin_model import write_builtin_model
from tests.stack import Stack


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model (random weights), written once per session."""
    return write_builtin_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
async def torch_stack(nats_url: str, tiny_dir: Path) -> AsyncIterator[Stack]:
    """One prefill and one decode worker on the real engine, gateway and conductor."""
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256}
    async with Stack(nats_url, worker=worker,
                     gateway_options={"model_path": str(tiny_dir)}) as stack:
        yield stack
