"""Load a Hugging Face checkpoint directory (safetensors, sharded or not) into `CausalLM`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import CausalLM
from shared.errors import ConfigError

# Ours fused (a name part) -> the checkpoint's parts; an expert's MLP fuses like a dense one.
_FUSED = {
    ".qkv_proj.": (".q_proj.", ".k_proj.", ".v_proj."),
    ".gate_up_proj.": (".gate_proj.", ".up_proj."),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / name for name in weight_map.values()})
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in {model_dir}")
    return files


def read_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                if not name.endswith(_IGNORED_SUFFIXES):
                    yield name, handle.get_tensor(name)


def load_weights(model: CausalLM, model_dir: Path, dtype: torch.dtype) -> None:
    """Fill `model` from the checkpoint, fusing q/k/v and gate/up; every parameter must be
    found exactly once."""
    tensors = dict(read_tensors(model_dir))
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        state[name] = _find(name, tensors).to(dtype)
    unused = set(tensors) - _consumed(state.keys())
    if model.config.tie_word_embeddings:
        unused.discard("lm_head.weight")
    if unused:
        raise ConfigError(f"checkpoint has weights the model does not use: {sorted(unused)[:5]}")
    model.load_state_dict(state, strict=True)


def _find(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    for fused, parts in _FUSED.items():
        if fused in name:
            pieces = [tensors.get(name.replace(fused, part)) for part in parts]
            if any(p is None for p in pieces):
                raise ConfigError(f"checkpoint lacks one of {parts} for {name}")
            return torch.cat(pieces, dim=0)  # type: ignore[arg-type]
    if name not in tensors:
        raise ConfigError(f"checkpoint lacks {name}")
    return tensors[name]


def _consumed(names: Iterator[str] | object) -> set[str]:
    consumed: set[str] = set()
    for name in names:  # type: ignore[attr-defined]
        for fused, parts in _FUSED.items():
            if fused in name:
                consumed.update(name.replace(fused, part) for part in parts)
                break
        else:
            consumed.add(name)
    return consumed
