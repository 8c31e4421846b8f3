"""Every attention backend against the per-sequence reference, on mixed batches: fresh
prompts, chunks after a cached prefix, and decode tokens, in scattered blocks (fp32)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention import (
    AttentionMetadata,
    ReferenceAttention,
    SequenceSlice,
    TorchAttention,
    compute_dtype,
    make_backend,
)
from engine.kv_cache import KvCache
from engine.linear import cpu_has_amx
from shared.errors import ConfigError

BLOCK_SIZE, NUM_BLOCKS, HQ, HKV, D = 4, 96, 8, 2, 16
CPU = torch.device("cpu")
# (tokens already in the pool, new tokens this step)
MIXES = {
    "decode": [(5, 1), (17, 1), (40, 1), (1, 1)],
    "prefill": [(0, 9), (0, 23), (0, 1)],
    "mixed": [(0, 13), (12, 6), (30, 1), (3, 1), (0, 2), (21, 1)],
    "one chunk, many decodes": [(8, 40), *[(10 + i, 1) for i in range(12)]],
    "one prompt": [(0, 31)],
    "equal chunks after cached context": [(7, 4), (0, 4), (19, 4)],  # dense, Qmax 4
    "one token, nothing cached": [(0, 1)],  # its block's other slots are not its context
}


def batch(mix: list[tuple[int, int]], seed: int, *, is_shuffled: bool = True
          ) -> tuple[torch.Tensor, KvCache, AttentionMetadata]:
    """Queries and a pool filled with random K/V for every context; blocks shuffled, or
    each sequence's consecutive (read in place by the reference)."""
    generator = torch.Generator().manual_seed(seed)
    kv = KvCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=HKV,
                 head_dim=D, dtype=torch.float32, device=CPU)
    kv.data.normal_(generator=generator)
    free = list(range(NUM_BLOCKS))[::-1]
    if is_shuffled:
        random.Random(seed).shuffle(free)
    sequences, slots, offset = [], [], 0
    for cached, new in mix:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        sequences.append(SequenceSlice(offset, new, total, blocks))
        positions = torch.arange(cached, total)
        slots.append(torch.tensor(blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE
                     + positions % BLOCK_SIZE)
        offset += new
    q = torch.randn(offset, HQ, D, generator=generator)
    return q, kv, AttentionMetadata(torch.cat(slots), sequences)


def attend(backend: object, q: torch.Tensor, kv: KvCache, meta: AttentionMetadata,
           plan: object = None) -> torch.Tensor:
    plan = backend.plan(meta, kv) if plan is None else plan  # type: ignore[attr-defined]
    return backend.attend(q, kv, 1, plan)  # type: ignore[attr-defined]


@pytest.mark.parametrize("is_shuffled", [True, False])
@pytest.mark.parametrize("mix", list(MIXES))
def test_both_torch_layouts_equal_the_reference(mix: str, is_shuffled: bool) -> None:
    q, kv, meta = batch(MIXES[mix], seed=len(mix), is_shuffled=is_shuffled)
    expected = attend(ReferenceAttention(CPU), q, kv, meta)
    backend = TorchAttention(CPU)
    max_query = max(s.query_len for s in meta.sequences)
    for plan in (backend.padded(meta, kv, max_query), backend.packed(meta, kv), None):
        assert torch.allclose(attend(backend, q, kv, meta, plan), expected, atol=1e-5)


def test_the_torch_backend_packs_a_long_chunk_among_decodes_and_pads_decodes() -> None:
    backend = TorchAttention(CPU)
    _, kv, chunky = batch(MIXES["one chunk, many decodes"], seed=1)
    _, _, decodes = batch(MIXES["decode"], seed=1)
    assert type(backend.plan(chunky, kv)).__name__ == "PackedPlan"
    assert type(backend.plan(decodes, kv)).__name__ == "PaddedPlan"


@pytest.mark.slow
@pytest.mark.parametrize("mix", ["mixed", "one chunk, many decodes"])
def test_flex_attention_equals_the_reference(mix: str) -> None:
    q, kv, meta = batch(MIXES[mix], seed=3)
    expected = attend(ReferenceAttention(CPU), q, kv, meta)
    assert torch.allclose(attend(make_backend("flex", CPU, HQ), q, kv, meta), expected,
                          atol=1e-5)


def test_flashinfer_is_refused_without_cuda_and_auto_picks_by_cpu_and_dtype() -> None:
    with pytest.raises(ConfigError, match="flashinfer"):
        make_backend("flashinfer", CPU, HQ)
    with pytest.raises(ConfigError, match="inductor"):
        make_backend("inductor", torch.device("cuda"), HQ)
    assert make_backend("auto", CPU, HQ).name == "torch"  # fp32
    # A bf16 pool: the kernel where SDPA would copy K and V to fp32 (no AMX).
    assert make_backend("auto", CPU, HQ, torch.bfloat16).name == (
        "torch" if cpu_has_amx() else "inductor")
    with pytest.raises(ConfigError, match="unknown attention backend"):
        make_backend("fast", CPU, HQ)


def test_a_bf16_pool_is_attended_in_fp32_on_this_cpu_and_returned_in_bf16() -> None:
    q, kv, meta = batch(MIXES["mixed"], seed=5)
    expected = attend(ReferenceAttention(CPU), q, kv, meta)  # fp32
    bf16 = KvCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                   num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, device=CPU,
                   storage=kv.data.to(torch.bfloat16))
    out = attend(TorchAttention(CPU), q.to(torch.bfloat16), bf16, meta)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), expected, atol=3e-2)


def test_a_cpu_without_amx_computes_attention_in_fp32() -> None:
    """Its bf16 SDPA ran 5x slower than fp32 on a Zen 4 EPYC (AVX512-BF16, no AMX), 2-5x on
    CPUs without bf16 units; with AMX, and on CUDA, the pool's dtype."""
    assert compute_dtype(CPU, torch.bfloat16) == (
        torch.bfloat16 if cpu_has_amx() else torch.float32)
    assert compute_dtype(CPU, torch.float32) == torch.float32
    assert compute_dtype(torch.device("cuda"), torch.bfloat16) == torch.bfloat16
