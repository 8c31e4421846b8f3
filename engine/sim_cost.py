"""The simulated accelerator's cost model: how long a model step takes on a given device.

Roofline per step: a step costs the larger of its compute time (FLOPs over peak FLOP/s x
`compute_efficiency`) and its memory time (bytes read and written over bandwidth x
`bandwidth_efficiency`), plus a fixed `step_overhead_s` (kernel launches, scheduling).

Measured refinements, for devices where the plain roofline is far off (a CPU): the matmuls'
achieved FLOP/s by the number of token rows in the step (`matmul_flops_by_rows`: small-batch
GEMMs reach neither peak FLOP/s nor peak bandwidth there), attention's achieved FLOP/s, the
fixed time of one attention call (`attention_call_s`) for engines that attend sequence by
sequence, and the host's work per sequence per step (`sequence_overhead_s`: block tables,
sampling). They are properties of the device, its kernels and its host, measured with
microbenchmarks, never fitted to an engine's step times.

FLOPs of a sequence computing `n` new tokens after `c` cached ones (a multiply-add is 2):
    linear:     2 x layer_params x n  (+ 2 x vocab x hidden for each sampled token)
    attention:  4 x layers x heads x head_dim x (n x c + n (n + 1) / 2)   (QK^T and PV, causal)
Bytes of a step: every weight once (the batch shares them), the KV the step reads (each
sequence's context) and writes (its new tokens). Prefill is compute-bound, decode memory-bound;
the roofline picks which without being told.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from engine.model_config import ModelConfig


@dataclass(frozen=True)
class Accelerator:
    """A device (or a tensor-parallel group of `num_devices` counted as one: their FLOP/s,
    bandwidth and memory add; the all-reduces between them are not modelled)."""

    name: str
    peak_flops: float  # dense, at the profile's dtype, per device
    memory_bytes_per_s: float
    memory_bytes: float
    num_devices: int = 1
    compute_efficiency: float = 0.5  # achieved / peak FLOP/s on large matmuls
    bandwidth_efficiency: float = 0.75  # achieved / peak bandwidth streaming weights and KV
    step_overhead_s: float = 0.0
    matmul_flops_by_rows: tuple[tuple[int, float], ...] = ()  # (rows, FLOP/s), rows ascending
    attention_call_s: float = 0.0  # per sequence per layer
    attention_flops_per_s: float = 0.0  # achieved by attention; 0: peak x compute_efficiency
    sequence_overhead_s: float = 0.0  # host work per sequence per step

    def matmul_flops(self, num_rows: int) -> float:
        """Achieved FLOP/s of a matmul over `num_rows` token rows: the measured curve,
        interpolated in log(rows) and clamped at its ends, or peak x efficiency."""
        curve = self.matmul_flops_by_rows
        if not curve:
            return self.peak_flops * self.compute_efficiency
        if num_rows <= curve[0][0]:
            return curve[0][1]
        for (low_rows, low), (high_rows, high) in itertools.pairwise(curve):
            if num_rows <= high_rows:
                fraction = math.log(num_rows / low_rows) / math.log(high_rows / low_rows)
                return low + (high - low) * fraction
        return curve[-1][1]


@dataclass(frozen=True)
class SimProfile:
    """A model on an accelerator."""

    name: str
    model: ModelConfig
    accelerator: Accelerator
    dtype_bytes: int = 2
    memory_utilization: float = 0.9  # of device memory for weights + KV, as vLLM's default

    @property
    def kv_dtype(self) -> str:
        """The KV pool's dtype name (as torch spells it) for `dtype_bytes`."""
        return {4: "float32", 2: "bfloat16", 1: "float8_e4m3fn"}[self.dtype_bytes]

    @property
    def layer_params(self) -> int:
        m = self.model
        attention = m.hidden_size * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads)
        mlp = 3 * m.hidden_size * m.intermediate_size
        return m.num_layers * (attention + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.model.vocab_size * self.model.hidden_size

    @property
    def num_params(self) -> int:
        embeddings = 1 if self.model.tie_word_embeddings else 2
        return self.layer_params + embeddings * self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        """Bytes a step reads: the layers and the LM head (an embedding lookup reads rows)."""
        return (self.layer_params + self.lm_head_params) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m.num_layers * m.num_kv_heads * m.head_dim * self.dtype_bytes

    def kv_capacity_tokens(self) -> int:
        device = self.accelerator
        usable = device.memory_bytes * device.num_devices * self.memory_utilization
        return max(0, int((usable - self.num_params * self.dtype_bytes)
                          // self.kv_bytes_per_token))

    def attention_flops(self, num_new: int, num_cached: int) -> float:
        m = self.model
        pairs = num_new * num_cached + num_new * (num_new + 1) / 2
        return 4 * m.num_layers * m.num_heads * m.head_dim * pairs

    def prefill_flops(self, num_new: int, num_cached: int = 0) -> float:
        return (2 * self.layer_params * num_new + 2 * self.lm_head_params
                + self.attention_flops(num_new, num_cached))

    def prefill_s(self, sequences: Iterable[tuple[int, int]]) -> float:
        """One prefill step over `(num_new, num_cached)` per sequence."""
        rows = num_seqs = 0
        attention = bytes_moved = 0.0
        for num_new, num_cached in sequences:
            rows += num_new
            num_seqs += 1
            attention += self.attention_flops(num_new, num_cached)
            bytes_moved += self.kv_bytes_per_token * (num_new + num_cached)
        return self._step_s(rows, num_seqs, attention, self.weight_bytes + bytes_moved)

    def decode_s(self, context_lens: Iterable[int]) -> float:
        """One decode step: each sequence adds a token after `context_len` in its cache."""
        num_seqs = 0
        attention = bytes_moved = 0.0
        for context_len in context_lens:
            num_seqs += 1
            attention += self.attention_flops(1, context_len)
            bytes_moved += self.kv_bytes_per_token * (context_len + 1)
        return self._step_s(num_seqs, num_seqs, attention, self.weight_bytes + bytes_moved)

    def _step_s(self, num_rows: int, num_seqs: int, attention_flops: float,
                bytes_moved: float) -> float:
        """Roofline of a step whose layers' matmuls see `num_rows` token rows and whose LM
        head sees one row per sequence (only the last token of each is sampled)."""
        device = self.accelerator
        n = device.num_devices
        compute_s = (2 * self.layer_params * num_rows / device.matmul_flops(num_rows)
                     + 2 * self.lm_head_params * num_seqs / device.matmul_flops(num_seqs)
                     + attention_flops / (device.attention_flops_per_s
                                          or device.peak_flops * device.compute_efficiency)
                     ) / n + device.attention_call_s * self.model.num_layers * num_seqs
        memory_s = bytes_moved / (device.memory_bytes_per_s * device.bandwidth_efficiency * n)
        return (max(compute_s, memory_s) + device.step_overhead_s
                + device.sequence_overhead_s * num_seqs)


def _llama3(**shape: int) -> ModelConfig:
    return ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "num_key_value_heads": 8,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, **shape})


# Both numbers measured on a real H200 (dense bf16 matmul; streaming copy).
H200 = Accelerator(name="h200", peak_flops=790e12, memory_bytes_per_s=4.3e12,
                   memory_bytes=141e9)
LLAMA_3_8B = _llama3(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32)
LLAMA_3_70B = _llama3(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64)

QWEN_2_5_7B = ModelConfig.from_dict({
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "rope_theta": 1000000.0, "max_position_embeddings": 32768})

PROFILES = {
    "llama-3-8b-h200": SimProfile("llama-3-8b-h200", LLAMA_3_8B, H200),
    # A second model of the same class (a cluster serving two models).
    "qwen-2.5-7b-h200": SimProfile("qwen-2.5-7b-h200", QWEN_2_5_7B, H200),
    # 140 GB of bf16 weights do not fit one H200: served tensor-parallel over four.
    "llama-3-70b-h200x4": SimProfile("llama-3-70b-h200x4", LLAMA_3_70B,
                                     replace(H200, name="h200x4", num_devices=4)),
}
