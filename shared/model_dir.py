"""Where the built-in model lives (no torch here: the gateway reads its tokenizer)."""

from __future__ import annotations

from pathlib import Path

import platformdirs

BUILTIN_MODEL_NAME = "halfmoon-tiny"


def default_model_dir() -> Path:
    return Path(platformdirs.user_cache_dir("halfmoon")) / "models" / BUILTIN_MODEL_NAME


def resolve_model_dir(model_path: str | None) -> Path:
    return Path(model_path).expanduser() if model_path else default_model_dir()
