"""A Llama-family model's shape, read from a Hugging Face `config.json`: Llama 2/3, Mistral,
Qwen2, Qwen3 (q/k norms) and Qwen3-MoE (routed experts in the MLP)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_QWEN = ("qwen2", "qwen3", "qwen3_moe")


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts: each token runs through `top_k` of `num_experts` MLPs, weighted."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    is_top_k_normalized: bool  # the top-k weights renormalized to sum to 1
    layers: frozenset[int]  # the layers whose MLP is routed (the others are dense)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MoeConfig | None:
        # The Hub's Qwen3-MoE configs say `num_experts`; transformers 5 writes the other.
        num_experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
        if not num_experts:
            return None
        step = raw.get("decoder_sparse_step") or 1
        dense = set(raw.get("mlp_only_layers") or ())
        return cls(num_experts=num_experts, top_k=raw["num_experts_per_tok"],
                   intermediate_size=raw["moe_intermediate_size"],
                   is_top_k_normalized=bool(raw.get("norm_topk_prob", False)),
                   layers=frozenset(i for i in range(raw["num_hidden_layers"])
                                    if i not in dense and (i + 1) % step == 0))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None  # attention here is full: contexts are capped to it
    has_qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope
    moe: MoeConfig | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {architecture!r}; supported: "
                              f"{sorted(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            architecture=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            has_qkv_bias=family == "qwen2" or raw.get("attention_bias", False),
            rope_scaling=_rope_scaling(raw),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_ids(eos),
            sliding_window=_sliding_window(raw, family),
            has_qk_norm=family in ("qwen3", "qwen3_moe"),
            moe=MoeConfig.from_dict(raw) if family == "qwen3_moe" else None,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        config_path = Path(path) / "config.json"
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {config_path}: {exc}") from exc
        generation = Path(path) / "generation_config.json"
        if generation.exists():  # its eos ids (Llama 3 lists several) join config.json's
            try:
                eos = json.loads(generation.read_text()).get("eos_token_id")
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read {generation}: {exc}") from exc
            raw = {**raw, "eos_token_id": sorted({*_as_ids(raw.get("eos_token_id")),
                                                  *_as_ids(eos)})}
        return cls.from_dict(raw)


def _as_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)  # type: ignore[arg-type]


def _sliding_window(raw: dict[str, Any], family: str) -> int | None:
    window = raw.get("sliding_window")
    if family in _QWEN and not raw.get("use_sliding_window", False):
        return None
    return int(window) if window else None


def _rope_theta(raw: dict[str, Any]) -> float:
    parameters = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta") or parameters.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else {**scaling, "rope_type": kind}
