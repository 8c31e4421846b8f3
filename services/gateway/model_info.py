"""What the gateway needs to know of the served model, read from its directory (no torch):
its context and vocabulary (`config.json`), and the sampling its makers recommend
(`generation_config.json`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import ConfigError
from shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    max_position_embeddings: int
    vocab_size: int


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets: OpenAI's defaults, or a model's
    own from its `generation_config.json` (Qwen2.5's temperature 0.7, top_p 0.8, top_k 20,
    repetition_penalty 1.05, say), as vLLM and SGLang apply them. top_k None: off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # `max_new_tokens`: a chat request's output, unless it says


OPENAI_SAMPLING = SamplingDefaults()
_SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                    "repetition_penalty": float, "max_new_tokens": int}
_AS_REQUEST_FIELD = {"max_new_tokens": "max_tokens"}
_ALLOWED = {  # what a request may send (validation.py)
    "temperature": lambda v: 0.0 <= v <= 2.0, "top_p": lambda v: 0.0 < v <= 1.0,
    "top_k": lambda v: v > 0, "min_p": lambda v: 0.0 <= v <= 1.0,
    "repetition_penalty": lambda v: 0.0 < v <= 2.0, "max_tokens": lambda v: v > 0,
}


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    """The model's recommended sampling (`generation_config.json`), over OpenAI's defaults
    for what it does not set; OpenAI's alone without the file."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return OPENAI_SAMPLING
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
        found = {_AS_REQUEST_FIELD.get(name, name): kind(raw[name])
                 for name, kind in _SAMPLING_FIELDS.items() if raw.get(name) is not None}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if found.get("top_k", 1) <= 0:  # 0 or -1: off, as in a request
        found["top_k"] = None
    # A value a request could not send is left out, never made the 400 of every request
    # that sent none.
    usable = {name: value for name, value in found.items()
              if value is None or _ALLOWED[name](value)}
    if usable != found:
        log.warning("model.sampling_defaults_ignored", path=str(path),
                    ignored=sorted(set(found) - set(usable)))
    return SamplingDefaults(**usable)


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
