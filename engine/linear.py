"""Linear layers that pick the faster CPU kernel for the step's shape.

Measured facts about CPU GEMMs, which the engine works around on CPU only (CUDA runs plain
`F.linear`):

* On a CPU with bf16 units (AVX512-BF16 / AMX), oneDNN runs a bf16 linear 1.25-1.6x faster
  with its weight reordered once into the kernel's own layout ("prepacked") than from the
  plain row-major weight (a 2-core Sapphire Rapids VM, 1024 -> 5632: 378 -> 259 us at 1
  token, 470 -> 284 at 32, 2405 -> 1851 at 512), with bit-identical outputs. The weight is
  prepacked when the model is loaded and the plain copy freed (no second copy in memory).
* Without bf16 units (a 2-core AMD EPYC, AVX2) bf16 GEMMs run several times slower than
  fp32 (17 vs 101 GFLOP/s at 512 x 1024 x 2816), and MKL's fp32 GEMM is slow at few rows
  (it repacks the weight on every call). oneDNN's fp32 kernel on a weight prepacked once
  runs at the memory system's speed there: the linear layers of one 1024-wide Llama layer
  plus its vocabulary head took 11.3 ms at 8 rows against 35.9 (MKL fp32) and 42.8 (bf16),
  28.1 at 32 rows against 49.7, 6.3 at 1 row against 6.2 (bf16); from 512 rows up MKL's
  fp32 won by 0-15 %. So both fp32 and bf16 weights are held as fp32 in oneDNN's layout
  there (`--cpu-weights packed`, the default; `plain` keeps them as loaded, e.g. for a worker
  that only prefills long prompts): a bf16 model's linear weights take twice the memory and
  its GEMMs run in fp32 (inputs upcast, outputs cast back: storage, KV and outputs stay
  bf16).
* An fp32 model's weights are held in oneDNN's fp32 layout too, but on CPUs with AMX (the
  Sapphire Rapids VM above: there MKL's plain fp32 won at 1 row). On a 2-core AMD EPYC with
  AVX512-BF16 and no AMX (Zen 4), `python -m bench.engine_throughput --dtype float32` ran
  decode at 1 / 8 / 32 sequences at 19.0 / 137 / 221 tok/s packed against 15.2 / 66.9 / 143
  plain (transformers 14.9 / 64.9 / 145), prefill of 512 tokens 466 against 401 (README).
* Small weights (under 2^20 values) stay plain: oneDNN's fixed cost per call outweighs its
  gain there (the built-in model's decode step took twice as long prepacked).
* With plain weights (or a torch build without oneDNN's prepacking), a bf16 weight is
  upcast on the fly when a step carries many tokens, 1024 output columns at a time (each
  slice is multiplied while it is still in cache); below 16 tokens the bf16 kernel runs.
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
# oneDNN's call costs ~30 us more than MKL's: at 1 row a 512 x 512 weight ran 46 against
# 28 us prepacked, 1024 x 1024 90 against 105 (8 rows: 62 / 86 and 166 / 400).
PACK_MIN_ELEMENTS = 2**20


@dataclass(frozen=True)
class CpuGemmPolicy:
    upcast_min_tokens: int | None  # None: never upcast
    chunk_columns: int
    # The dtype weights are held in, in oneDNN's layout (None: plain row-major): bf16 on CPUs
    # with bf16 units, fp32 (for fp32 and bf16 models alike) on CPUs without.
    packed_dtype: torch.dtype | None = None
    pack_min_elements: int = PACK_MIN_ELEMENTS  # smaller weights stay plain


@functools.cache
def cpu_has_native_bf16() -> bool:
    return cpu_has_amx() or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()


@functools.cache
def cpu_has_amx() -> bool:
    return getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()


def policy_for(device: torch.device, dtype: torch.dtype, weights: str = "packed"
               ) -> CpuGemmPolicy | None:
    """How a model of `dtype` runs its linear layers on `device`. `weights` "packed" holds
    them as measured fastest for decode (above); "plain" keeps them as loaded: faster at many
    rows (MKL beat oneDNN by 0-15 % from 512 up: long prefills), and for a bf16 model half
    the memory and faster at one row (decode at batch 1 is memory-bound)."""
    if device.type != "cpu":
        return None
    is_bf16 = dtype == torch.bfloat16
    is_slow_bf16 = is_bf16 and not cpu_has_native_bf16()
    packed = None
    if weights == "packed" and is_bf16 and cpu_has_native_bf16():
        packed = torch.bfloat16 if prepacking_works(torch.bfloat16) else None
    elif weights == "packed" and not cpu_has_amx() and prepacking_works(torch.float32):
        packed = torch.float32  # with AMX, fp32 stays plain: packed, it lost at 1 row
    upcast = UPCAST_MIN_TOKENS if is_slow_bf16 else None  # for weights left plain
    return CpuGemmPolicy(upcast, CHUNK_COLUMNS, packed)


# How many rows oneDNN's layout is chosen for; the packed weight serves any number of rows.
_PACK_FOR_ROWS = 32


@functools.cache
def prepacking_works(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU reorder and run prepacked `dtype` weights (private
    oneDNN ops, as torch.compile's CPU backend uses them), checked once against `F.linear`
    (fp32 within rounding: oneDNN sums in another order)."""
    try:
        weight = torch.randn(64, 32).to(dtype)
        x = torch.randn(3, 32).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_FOR_ROWS)
        return torch.allclose(_packed_linear(x, packed, None), F.linear(x, weight),
                              rtol=1e-5, atol=1e-5)
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
    packed_bias: torch.Tensor | None = None  # the bias in the packed weight's dtype

    def set_policy(self, policy: CpuGemmPolicy | None) -> None:
        """Follow `policy`; a prepacking one reorders the (loaded) weight once, for good,
        unless it is too small to gain."""
        self.policy = policy
        if policy is None or policy.packed_dtype is None or self.packed is not None \
                or self.weight.numel() < policy.pack_min_elements:
            return
        dtype = policy.packed_dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().to(dtype),
                                                             _PACK_FOR_ROWS)
        self.weight.data = self.weight.data.new_empty(0)  # one copy of the weights
        if self.bias is not None:
            self.packed_bias = self.bias.detach().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out = _packed_linear(x.to(self.packed.dtype), self.packed, self.packed_bias)
            return out.to(x.dtype)
        return linear(x, self.weight, self.bias, self.policy)

