"""Tiny random-weight Hugging Face checkpoints for checking our engine against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def make_checkpoint(path: Path, family: str, **overrides: Any) -> Path:
    """Save a tiny `family` model ("llama" with llama3 rope scaling, "llama2-linear",
    "mistral", "qwen2", "qwen3", "qwen3_moe") with random weights to `path`."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 eos_token_id=299, bos_token_id=1) | overrides
    torch.manual_seed(1234)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_scaling=LLAMA3_ROPE))
    elif family == "llama2-linear":
        model = LlamaForCausalLM(LlamaConfig(
            **shape, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, sliding_window=256))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=24))
    elif family == "qwen3_moe":  # layer 1 dense, layers 0 and 2 routed: 6 experts, top 2
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **shape, head_dim=16, num_experts=6, num_experts_per_tok=2,
            moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1]))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    with torch.no_grad():  # scale weights up so that logits are peaked and greedy is stable
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    model.eval().save_pretrained(path, safe_serialization=True)
    return path


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def greedy_reference(model: Any, prompt: list[int], num_tokens: int
                     ) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens after `prompt` and the log_softmax at every position of
    prompt + output."""
    ids = list(prompt)
    for _ in range(num_tokens):
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return ids[len(prompt):], log_probs
