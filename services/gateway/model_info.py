"""What the gateway needs to know of the served model, read from its directory (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ConfigError


@dataclass(frozen=True)
class ModelInfo:
    max_position_embeddings: int
    vocab_size: int


def read_model_info(model_dir: Path) -> ModelInfo:
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
        return ModelInfo(int(raw.get("max_position_embeddings", 2048)), int(raw["vocab_size"]))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
