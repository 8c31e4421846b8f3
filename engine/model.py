"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE) over a paged KV cache.

Inputs are flattened: the new tokens of every sequence in the batch, one after another
(`[T]`), with their positions. Linear layers and the MLP run on all T tokens at once;
attention is one call per layer through the chosen backend (`engine.attention`), each
sequence over exactly its own context, read through its block table. q/k/v and gate/up
projections are fused at load time (one matmul each). A routed MLP (`SparseMoe`) runs each
expert over only the tokens routed to it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, make_backend
from engine.kv_cache import KvCache
from engine.linear import CpuGemmPolicy, Linear, linear
from engine.model_config import ModelConfig, MoeConfig
from engine.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32, then cast back before the weight, as transformers' Llama does (the same
        # math as pow, mean, rsqrt and multiply, in one call).
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=config.has_qkv_bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size,
                                bias=False)
        self.q_norm = self.k_norm = None
        if config.has_qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KvCache, rope: RotaryEmbedding, attention: AttentionBackend) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, positions)
        kv.write(self.layer, meta.slot_mapping, k, v)
        return self.o_proj(attention.attend(q, kv, self.layer, meta.plan).flatten(1))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoe(nn.Module):
    """A router (`gate`) picks each token's top-k experts; each expert runs once per step
    over the tokens routed to it, and their outputs are summed with the router's weights."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden_size, moe.intermediate_size)
                                     for _ in range(moe.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = probs.topk(self.moe.top_k, dim=-1)  # [T, k]
        if self.moe.is_top_k_normalized:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        # (token, expert) pairs sorted by expert: each expert's tokens are one slice.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.moe.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // self.moe.top_k
                out.index_add_(0, tokens, expert(x[tokens]) * weights[pairs].unsqueeze(1))
                start += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoe(config.hidden_size, config.moe)
            if config.moe is not None and layer in config.moe.layers
            else MLP(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KvCache, rope: RotaryEmbedding, attention: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv, rope, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # Made without its random init, as every weight here (they are loaded): on the meta
        # device `normal_` imports torch._dynamo and triton, ~1 s and ~150 MB a worker.
        self.embed_tokens = nn.Embedding.from_pretrained(
            torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Weights follow Hugging Face names (`model.layers.N....`), with fused projections."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope: RotaryEmbedding | None = None
        self.gemm_policy: CpuGemmPolicy | None = None
        self.attention: AttentionBackend | None = None  # made by `init_runtime`

    def set_gemm_policy(self, policy: CpuGemmPolicy | None) -> None:
        """After the weights are loaded (a prepacking policy reorders them for good)."""
        self.gemm_policy = policy
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_policy(policy)

    def init_runtime(self, max_positions: int, device: torch.device,
                     attention: str = "auto", kv_dtype: torch.dtype = torch.float32) -> None:
        """Ready the model to run on `device`: rotary tables and the attention backend (for
        a KV pool in `kv_dtype`)."""
        config = self.config
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)
        self.attention = make_backend(attention, device, config.num_heads, kv_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KvCache, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`. `on_layer(i)` runs after layer
        i has written its K/V (layer-wise KV transfer hooks in here)."""
        if self.rope is None or self.attention is None:
            raise RuntimeError("call init_runtime() before forward()")
        if meta.plan is None:  # (a decode graph brings its own, in static buffers)
            meta.plan = self.attention.plan(meta, kv)
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, meta, kv, self.rope, self.attention)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            weight = self.model.embed_tokens.weight
            return linear(hidden, weight, None, self.gemm_policy).float()
        return self.lm_head(hidden).float()
