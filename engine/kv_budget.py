"""How many KV blocks a worker's pool gets: from a memory budget, not a fixed count.

`--kv-cache-memory-gb G` gives the pool G GiB on any device. Else, on CUDA,
`--gpu-memory-utilization U` gives it what is left of U of the device's memory once the
weights (counted from the config), what other processes hold, and a reserve for activations
are taken. Else `--num-blocks` decides, as before.
"""

from __future__ import annotations

import torch

from engine.model_config import ModelConfig
from shared.errors import ConfigError
from shared.messages import KvPoolLayout

ACTIVATION_RESERVE_BYTES = 2 * 2**30  # CUDA: workspace, activations, the sampler's logits


def weight_bytes(config: ModelConfig, dtype: torch.dtype) -> int:
    """The weights' size, counted from the config (no weights need to be loaded)."""
    hidden, layers = config.hidden_size, config.num_layers
    attention = hidden * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    dense = 3 * hidden * config.intermediate_size
    mlps = dense * layers
    if config.moe is not None:
        routed = config.moe.num_experts * 3 * hidden * config.moe.intermediate_size
        routed += config.moe.num_experts * hidden  # the router
        mlps += len(config.moe.layers) * (routed - dense)
    if config.has_qkv_bias:
        attention += config.head_dim * (config.num_heads + 2 * config.num_kv_heads)
    norms = layers * 2 * hidden + hidden
    if config.has_qk_norm:
        norms += layers * 2 * config.head_dim
    embeddings = (1 if config.tie_word_embeddings else 2) * config.vocab_size * hidden
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return (layers * attention + mlps + norms + embeddings) * itemsize


def pool_blocks(config: ModelConfig, layout: KvPoolLayout, *, device: torch.device,
                kv_cache_memory_gb: float = 0.0, gpu_memory_utilization: float = 0.0) -> int:
    """How many blocks of `layout`'s size the budget holds (`layout.num_blocks` when no
    budget is set)."""
    per_block = layout.block_bytes
    if kv_cache_memory_gb > 0:
        count = int(kv_cache_memory_gb * 2**30 // per_block)
        source = f"--kv-cache-memory-gb {kv_cache_memory_gb:g}"
    elif device.type == "cuda" and gpu_memory_utilization > 0:
        free, total = torch.cuda.mem_get_info(device)
        budget = (gpu_memory_utilization * total - (total - free)
                  - weight_bytes(config, getattr(torch, layout.dtype)) - ACTIVATION_RESERVE_BYTES)
        count = int(max(0.0, budget) // per_block)
        source = f"--gpu-memory-utilization {gpu_memory_utilization:g}"
    else:
        return layout.num_blocks
    if count < 1:
        raise ConfigError(f"{source} leaves no room for one KV block of {per_block} bytes")
    return count
