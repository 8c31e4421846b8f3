"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from engine.builtin_model import write_builtin_model
from tests.stack import Stack, torch_stack_on


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


@pytest.fixture(scope="module")
async def module_stack(nats_url: str, tiny_dir: Path) -> AsyncIterator[Stack]:
    """A disaggregated stack on the real engine, shared by one module's tests (each leaves
    it as it found it)."""
    async with torch_stack_on("disaggregated", nats_url, str(tiny_dir)) as running:
        yield running


@pytest.fixture
async def sdk(module_stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    """The `openai` SDK on `module_stack`, without retries (a test sees every error). A
    module that needs another stack defines its own `sdk`."""
    async with openai.AsyncOpenAI(base_url=module_stack.base_url, api_key="x", max_retries=0,
                                  timeout=120) as client:
        yield client
