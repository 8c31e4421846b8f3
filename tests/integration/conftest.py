"""Fixtures shared by the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.builtin_model import write_builtin_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny model (random weights), written once per session."""
    return write_builtin_model(tmp_path_factory.mktemp("model") / "tiny")
