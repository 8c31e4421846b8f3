"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Inputs are flattened: the new tokens of every sequence in the batch, one after another
(`[T]`), with their positions. Linear layers and the MLP run on all T tokens at once;
attention runs per sequence over exactly its own context (read through its block table), so
a decode batch is never padded to its longest sequence. q/k/v and gate/up projections are
fused at load time (one matmul each).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_cache import KvCache
from engine.linear import CpuGemmPolicy, Linear, linear
from engine.model_config import ModelConfig
from engine.rope import RotaryEmbedding


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a flattened batch."""

    query_start: int
    query_len: int
    context_len: int  # tokens in the cache once this step's tokens are written
    context_start: int | None  # offset in the step's gathered K/V
    # First slot of a context whose blocks are consecutive: read in place. Both None: the
    # sequence has no cached context and attends to this step's K/V.
    context_slot: int | None = None


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T]: where each new token's K/V goes
    sequences: list[SequenceSlice]
    # Slots of every cached context that is read this step, all sequences end to end: one
    # gather per layer instead of one per sequence.
    context_slots: torch.Tensor | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KvCache, rope: RotaryEmbedding) -> torch.Tensor:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rope.apply(q, k, positions)
        kv.write(self.layer, meta.slot_mapping, k, v)
        if meta.context_slots is not None:
            cached_k, cached_v = kv.gather(self.layer, meta.context_slots)
        out = torch.empty_like(q)
        for seq in meta.sequences:
            span = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.context_slot is not None:
                keys, values = kv.view(self.layer, seq.context_slot, seq.context_len)
            elif seq.context_start is not None:
                context = slice(seq.context_start, seq.context_start + seq.context_len)
                keys, values = cached_k[context], cached_v[context]
            else:
                keys, values = k[span], v[span]
            out[span] = _attend(q[span], keys, values, seq.context_len)
        return self.o_proj(out.flatten(1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int
            ) -> torch.Tensor:
    """Causal attention of q (`[L, Hq, D]`, the last L positions) over k/v (`[C, Hkv, D]`)."""
    query_len = q.shape[0]
    mask = None
    if 1 < query_len < context_len:  # chunk after a cached prefix: shift the causal band
        rows = torch.arange(query_len, device=q.device).unsqueeze(1) + (context_len - query_len)
        mask = torch.arange(context_len, device=q.device).unsqueeze(0) <= rows
    # 4-D inputs: with 3-D ones torch takes its slow "math" path (measured 5x slower on CPU).
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), attn_mask=mask,
        is_causal=query_len > 1 and query_len == context_len, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KvCache, rope: RotaryEmbedding) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, meta, kv, rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
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

    def set_gemm_policy(self, policy: CpuGemmPolicy | None) -> None:
        self.gemm_policy = policy
        for module in self.modules():
            if isinstance(module, Linear):
                module.policy = policy

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        config = self.config
        self.rope = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta,
                                    config.rope_scaling, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KvCache, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`. `on_layer(i)` runs after layer
        i has written its K/V (layer-wise KV transfer hooks in here)."""
        if self.rope is None:
            raise RuntimeError("call init_rope() before forward()")
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, positions, meta, kv, self.rope)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            weight = self.model.embed_tokens.weight
            return linear(hidden, weight, None, self.gemm_policy).float()
        return self.lm_head(hidden).float()
