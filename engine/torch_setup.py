"""How a `TorchEngine` is set up: its options, the device, the context it can serve, the
model loaded onto the device, decode graphs, and a KV pool in memory someone else holds."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_allocator import BlockAllocator
from engine.decode_graphs import DecodeGraphs, cuda_capture, eager_capture
from engine.kv_cache import KvCache
from engine.linear import policy_for
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.weights import load_weights
from shared.errors import ConfigError
from shared.logs import get_logger
from shared.messages import KvPoolLayout

log = get_logger(__name__)


@dataclass(frozen=True)
class EngineOptions:
    model_dir: Path
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    attention_backend: str = "auto"  # engine.attention.BACKENDS
    cpu_weights: str = "packed"  # engine.linear.policy_for
    num_blocks: int = 1024  # unless a memory budget below sizes the pool (engine.kv_budget)
    kv_cache_memory_gb: float = 0.0
    gpu_memory_utilization: float = 0.0
    # A colocated request's blocks: taken as it grows ("growth"), or for prompt + max_tokens
    # when it is admitted ("up-front": the engine's earlier policy, the memory benchmark's
    # baseline; it never preempts).
    kv_reservation: str = "growth"
    block_size: int = 16
    max_batch_size: int = 64
    max_batch_tokens: int = 2048
    max_wait_s: float = 0.01
    max_model_len: int | None = None
    is_prefix_caching: bool = True
    # Decode steps replayed as CUDA graphs ("cuda", `--cuda-graphs`), or through the same
    # static buffers without a graph ("eager": how they are checked on a CPU).
    decode_graphs: str = "off"


def device_for(options: EngineOptions) -> torch.device:
    """The engine's device; `ConfigError` before any load where it cannot serve."""
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {options.device}: this torch build sees no CUDA device "
                          f"(torch {torch.__version__})")
    if options.decode_graphs == "cuda" and device.type != "cuda":
        raise ConfigError(f"--cuda-graphs needs a CUDA device, not {device}")
    return device


def context_length(config: ModelConfig, options: EngineOptions, num_blocks: int) -> int:
    """The longest sequence (prompt and output) served: the model's, capped at its sliding
    window (full attention equals sliding-window attention only inside it), at
    `max_model_len`, and at what the whole KV pool holds (a sequence that outgrew the pool
    could only preempt itself, and then wait forever to be computed again)."""
    longest = config.max_position_embeddings
    wanted = min(options.max_model_len or longest, longest, config.sliding_window or longest)
    pool_tokens = num_blocks * options.block_size
    if pool_tokens >= wanted:
        return wanted
    log.warning("engine.max_model_len_capped", max_model_len=pool_tokens,
                model_max_model_len=wanted, num_blocks=num_blocks,
                block_size=options.block_size)
    return pool_tokens


def load_model(config: ModelConfig, options: EngineOptions, device: torch.device,
               max_model_len: int) -> CausalLM:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to_empty(device=device).to(options.dtype)
    load_weights(model, options.model_dir, options.dtype)
    model.set_gemm_policy(policy_for(device, options.dtype, options.cpu_weights))
    model.init_runtime(max_model_len, device, options.attention_backend, options.dtype)
    return model.eval()


def decode_graphs(model: CausalLM, kv: KvCache, allocator: BlockAllocator,
                  options: EngineOptions, max_model_len: int) -> DecodeGraphs | None:
    """The decode steps' graphs (`options.decode_graphs`), not yet captured; None when off."""
    mode = options.decode_graphs
    if mode == "off":
        return None
    if model.attention is None or model.attention.name not in ("torch", "inductor") \
            or model.config.moe:
        raise ConfigError("decode graphs need --attention-backend torch or inductor and a "
                          "dense model (mixture-of-experts routing has data-dependent shapes)")
    # Never freed: the padding rows of every graph write their K/V here.
    pad_block = allocator.allocate(1)[0]
    capture = cuda_capture(torch.cuda.graph_pool_handle()) if mode == "cuda" else eager_capture
    return DecodeGraphs(lambda ids, positions, meta: model(ids, positions, meta, kv), kv,
                        kv.data.device, pad_block, max_batch_size=options.max_batch_size,
                        max_context=max_model_len, capture=capture)


def kv_storage(buffer: memoryview, layout: KvPoolLayout) -> torch.Tensor:
    """The KV pool's tensor over host memory someone else holds (shared memory)."""
    shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat[:layout.size_bytes].view(getattr(torch, layout.dtype)).view(shape)
