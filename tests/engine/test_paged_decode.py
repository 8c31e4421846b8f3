"""The inductor backend's decode kernel (`engine.paged_decode`), which reads K/V from the
pool's blocks in place, against the per-sequence reference: every size that dynamo would
specialize (one sequence, one block, one key), a bf16 pool, no compile after the first,
and plain SDPA where inductor cannot build it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

from engine.attention import ReferenceAttention, TorchAttention, make_backend
from engine.kv_cache import KvCache
from engine.paged_decode import PagedDecode
from tests.engine.test_attention import BLOCK_SIZE, CPU, HKV, HQ, NUM_BLOCKS, D, attend, batch

DECODES = {
    "several, scattered": [(5, 1), (17, 1), (40, 1), (1, 1)],
    "one sequence": [(22, 1)],
    "one token, nothing cached": [(0, 1)],
    "one block each": [(2, 1), (0, 1), (3, 1)],
    "many": [(2 * i, 1) for i in range(17)],
}


@pytest.fixture(scope="module")
def backend() -> TorchAttention:
    """The kernel for every decode batch, one sequence too (serving leaves few to SDPA)."""
    backend = TorchAttention(CPU, PagedDecode(HQ), kernel_min_sequences=1)
    _, kv, _ = batch(DECODES["one sequence"], seed=0)
    backend.warm_up(kv)
    assert backend.is_decode_kernel_built  # this machine has the C++ compiler inductor needs
    return backend


@pytest.mark.parametrize("decodes", list(DECODES))
def test_the_decode_kernel_equals_the_reference(backend: TorchAttention, decodes: str) -> None:
    q, kv, meta = batch(DECODES[decodes], seed=len(decodes))
    expected = attend(ReferenceAttention(CPU), q, kv, meta)
    assert torch.allclose(attend(backend, q, kv, meta), expected, atol=1e-5)


def test_a_bf16_pool_is_computed_in_fp32_and_returned_in_bf16(backend: TorchAttention
                                                               ) -> None:
    q, kv, meta = batch(DECODES["several, scattered"], seed=7)
    bf16 = KvCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                   num_kv_heads=HKV, head_dim=D, dtype=torch.bfloat16, device=CPU,
                   storage=kv.data.to(torch.bfloat16))
    expected = attend(ReferenceAttention(CPU), q.to(torch.bfloat16).float(), KvCache(
        num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=HKV,
        head_dim=D, dtype=torch.float32, device=CPU, storage=bf16.data.float()), meta)
    assert PagedDecode(HQ).compile(bf16.data)
    out = attend(backend, q.to(torch.bfloat16), bf16, meta)
    assert out.dtype == torch.bfloat16
    # fp32 inside: only the output's rounding to bf16 apart from fp32 on the same inputs
    assert torch.allclose(out.float(), expected, rtol=1e-2, atol=1e-2)


def test_no_batch_compiles_the_kernel_again(backend: TorchAttention) -> None:
    """The batch's sizes are traced as unbacked symbols (no specialization of a size of 1)
    and without duck sizing, so one build serves every batch (a build takes seconds,
    mid-step)."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for seed, decodes in enumerate(DECODES.values()):
        q, kv, meta = batch(decodes, seed=seed)
        attend(backend, q, kv, meta)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_the_backend_decodes_a_few_sequences_through_sdpa_and_more_through_the_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    backend = make_backend("inductor", CPU, HQ)
    assert isinstance(backend, TorchAttention)
    q, kv, meta = batch(DECODES["one sequence"], seed=3)
    backend.warm_up(kv)
    kernel = backend._decode
    calls: list[int] = []

    def counted(q: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        calls.append(q.shape[0])
        return kernel(q, *args)  # type: ignore[misc]

    monkeypatch.setattr(backend, "_decode", counted)
    for decodes in ("one sequence", "several, scattered", "many"):
        q, kv, meta = batch(DECODES[decodes], seed=3)
        expected = attend(ReferenceAttention(CPU), q, kv, meta)
        assert torch.allclose(attend(backend, q, kv, meta), expected, atol=1e-5)
    assert calls == [17]  # the seventeen sequences'; one and four went through SDPA


FALLBACK = """
import torch, torch._inductor.config
torch._inductor.config.cpp.cxx = ("/nonexistent/c++",)
from engine.attention import ReferenceAttention, make_backend
from tests.engine.test_attention import CPU, HQ, attend, batch
backend = make_backend("inductor", CPU, HQ)
q, kv, meta = batch([(5, 1), (17, 1)], seed=1)
backend.warm_up(kv)
assert not backend.is_decode_kernel_built
assert torch.allclose(attend(backend, q, kv, meta),
                      attend(ReferenceAttention(CPU), q, kv, meta), atol=1e-5)
print("decoded through sdpa")
"""


def test_without_a_compiler_decode_runs_through_sdpa(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", FALLBACK], env=env, capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("decoded through sdpa")
    assert "attention.paged_decode_not_compiled" in done.stdout
