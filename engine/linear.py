"""Linear layers that pick the faster CPU kernel for the step's shape.

Measured facts about CPU GEMMs, which the engine works around on CPU only (CUDA runs plain
`F.linear`):

* On a CPU with bf16 units (AVX512-BF16 / AMX), oneDNN runs a bf16 linear 1.25-1.6x faster
  with its weight reordered once into the kernel's own layout ("prepacked") than from the
  plain row-major weight (a 2-core Sapphire Rapids VM, 1024 -> 5632: 378 -> 259 us at 1
  token, 470 -> 284 at 32, 2405 -> 1851 at 512), with bit-identical outputs. The weight is
  prepacked when the model is loaded and the plain copy freed (no second copy in memory).
* Without bf16 units (a 2-core AMD EPYC, AVX2, MKL) bf16 GEMMs run several times slower than
  fp32 (17 vs 101 GFLOP/s at 512 x 1024 x 2816). When a step carries many tokens (prefill,
  big decode batches) the weight is upcast on the fly, 1024 output columns at a time (each
  slice is multiplied while it is still in cache), in fp32; the result is cast back, so
  storage, KV and outputs stay bf16. Below 16 tokens the upcast costs more than it saves and
  the bf16 kernel runs.
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
    is_prepacked: bool = False  # bf16 weights in oneDNN's layout (CPUs with bf16 units)


@functools.cache
def cpu_has_native_bf16() -> bool:
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def policy_for(device: torch.device, dtype: torch.dtype) -> CpuGemmPolicy | None:
    if device.type != "cpu":
        return None
    is_bf16 = dtype == torch.bfloat16
    is_slow_bf16 = is_bf16 and not cpu_has_native_bf16()
    return CpuGemmPolicy(UPCAST_MIN_TOKENS if is_slow_bf16 else None, CHUNK_COLUMNS,
                         is_prepacked=is_bf16 and not is_slow_bf16 and prepacking_works())


# How many rows oneDNN's layout is chosen for; the packed weight serves any number of rows.
_PACK_FOR_ROWS = 32


@functools.cache
def prepacking_works() -> bool:
    """Whether this torch build reorders and runs prepacked bf16 weights (private oneDNN ops,
    as torch.compile's CPU backend uses them), checked once against `F.linear`."""
    try:
        weight = torch.randn(64, 32).to(torch.bfloat16)
        x = torch.randn(3, 32).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
        return bool(torch.equal(_packed_linear(x, packed, None), F.linear(x, weight)))
    except (AttributeError, RuntimeError):
        return False


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


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
    """`nn.Linear` (same parameters, same state dict until prepacked) that follows a
    `CpuGemmPolicy`."""

    policy: CpuGemmPolicy | None = None
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout; then `weight` is empty

    def set_policy(self, policy: CpuGemmPolicy | None) -> None:
        """Follow `policy`; a prepacking one reorders the (loaded) weight once, for good."""
        self.policy = policy
        if policy is not None and policy.is_prepacked and self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                                 _PACK_FOR_ROWS)
            self.weight.data = self.weight.data.new_empty(0)  # one copy of the weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias, self.policy)

