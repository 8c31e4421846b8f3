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
        context = int(raw.get("max_position_embeddings", 2048))
        window = raw.get("sliding_window")
        is_windowed = window and (raw.get("use_sliding_window", True)
                                  if raw.get("model_type") == "qwen2" else True)
        # The engine caps contexts at a sliding window (its attention is full): so do we.
        return ModelInfo(min(context, int(window)) if is_windowed else context,
                         int(raw["vocab_size"]))
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
