"""Linear layers that pick the faster CPU kernel for the step's shape.

Two measured facts about CPU GEMMs on this project's 2-core AMD EPYC (AVX2, MKL), which the
engine works around on CPU only (CUDA and CPUs with bf16 units run plain `F.linear`):

* bf16 GEMMs run several times slower than fp32 without AVX512-BF16/AMX (17 vs 101 GFLOP/s at
  512 x 1024 x 2816). When a step carries many tokens (prefill, big decode batches) the weight
  is upcast on the fly, 1024 output columns at a time (each slice is multiplied while it is
  still in cache), in fp32; the result is cast back, so storage, KV and outputs stay bf16.
  Below 16 tokens the upcast costs more than it saves and the bf16 kernel runs.
* Wide outputs (fused gate/up, the vocabulary head) with several rows run 1.1-1.5x faster as
  1024-column slices of the weight than as one GEMM (no copies: slices are views).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

UPCAST_MIN_TOKENS = 16  # measured break-even: below it the bf16 kernel wins
CHUNK_COLUMNS = 1024


@dataclass(frozen=True)
class CpuGemmPolicy:
    upcast_min_tokens: int | None  # None: never upcast
    chunk_columns: int


@functools.cache
def cpu_has_native_bf16() -> bool:
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def policy_for(device: torch.device, dtype: torch.dtype) -> CpuGemmPolicy | None:
    if device.type != "cpu":
        return None
    is_slow_bf16 = dtype == torch.bfloat16 and not cpu_has_native_bf16()
    return CpuGemmPolicy(UPCAST_MIN_TOKENS if is_slow_bf16 else None, CHUNK_COLUMNS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           policy: CpuGemmPolicy | None) -> torch.Tensor:
    if policy is None or x.shape[0] < 2:
        return F.linear(x, weight, bias)
    is_upcast = policy.upcast_min_tokens is not None and x.shape[0] >= policy.upcast_min_tokens
    if x.dtype != torch.float32 and not is_upcast:
        return F.linear(x, weight, bias)
    # fp32 compute, 1024 columns at a time; an upcast slice is used while still in cache.
    rows = policy.chunk_columns
    biases = bias.split(rows) if bias is not None else [None] * -(-weight.shape[0] // rows)
    x32 = x.float()
    out = torch.cat([F.linear(x32, w.float(), None if b is None else b.float())
                     for w, b in zip(weight.split(rows), biases, strict=True)], dim=-1)
    return out.to(x.dtype)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) that follows a `CpuGemmPolicy`."""

    policy: CpuGemmPolicy | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.policy)

