from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.hf_models import make_checkpoint


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest, llama_dir: Path, qwen2_dir: Path) -> Path:
    return llama_dir if request.param == "llama" else qwen2_dir
