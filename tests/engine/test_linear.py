"""The CPU GEMM policy's kernels give what `F.linear` gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.linear import (
    CpuGemmPolicy,
    Linear,
    cpu_has_amx,
    cpu_has_native_bf16,
    policy_for,
    prepacking_works,
)
from tests.engine.hf_models import hf_model, make_checkpoint
from tests.engine.test_against_transformers import (
    GREEDY,
    PROMPTS,
    generate,
    hf_greedy,
    start_engine,
)


def _prepacking(dtype: torch.dtype) -> pytest.MarkDecorator:
    return pytest.mark.skipif(not prepacking_works(dtype),
                              reason=f"this CPU or torch build has no prepacked {dtype} linear")


@_prepacking(torch.bfloat16)
@pytest.mark.parametrize("num_rows", [1, 5, 40, 300])
def test_a_prepacked_bf16_linear_equals_the_plain_one_and_keeps_one_copy(
        num_rows: int) -> None:
    torch.manual_seed(num_rows)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.set_policy(CpuGemmPolicy(None, 1024, torch.bfloat16, pack_min_elements=0))
    x = torch.randn(num_rows, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert layer.weight.numel() == 0  # the plain weight is freed, not kept beside the packed


@_prepacking(torch.float32)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 5, 40, 300])
def test_weights_prepacked_in_fp32_give_the_fp32_product_in_the_model_dtype(
        num_rows: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_rows)
    layer = Linear(64, 96, bias=True).to(dtype)
    weight, bias = layer.weight.detach().float(), layer.bias.detach().float()
    layer.set_policy(CpuGemmPolicy(None, 1024, torch.float32, pack_min_elements=0))
    x = torch.randn(num_rows, 64).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    # oneDNN sums in another order than MKL: equal within fp32 rounding, then cast alike.
    expected = F.linear(x.float(), weight, bias).to(dtype)
    rtol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # a rounding apart: one bf16 step
    assert torch.allclose(out.float(), expected.float(), rtol=rtol, atol=1e-5)
    assert layer.weight.numel() == 0


def test_each_cpu_holds_its_weights_as_measured_fastest_there() -> None:
    cpu = torch.device("cpu")
    bf16, fp32 = policy_for(cpu, torch.bfloat16), policy_for(cpu, torch.float32)
    assert bf16 is not None and fp32 is not None
    fp32_packed = torch.float32 if prepacking_works(torch.float32) else None
    if cpu_has_native_bf16():
        assert bf16.packed_dtype == (torch.bfloat16 if prepacking_works(torch.bfloat16)
                                     else None)
        assert fp32.packed_dtype == (None if cpu_has_amx() else fp32_packed)
    else:  # fp32 in oneDNN's layout for both where it works; bf16 left plain upcast
        assert bf16.packed_dtype == fp32.packed_dtype == fp32_packed
        assert bf16.upcast_min_tokens is not None and fp32.upcast_min_tokens is None
    assert policy_for(torch.device("meta"), torch.float32) is None


def test_a_weight_too_small_to_gain_stays_plain() -> None:
    small, large = Linear(512, 512, bias=False), Linear(1024, 1024, bias=False)
    for layer in (small, large):
        layer.set_policy(CpuGemmPolicy(None, 1024, torch.float32))
    assert small.packed is None and small.weight.numel() == 512 * 512
    assert (large.packed is not None) == prepacking_works(torch.float32)


def test_plain_weights_stay_as_loaded() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        policy = policy_for(cpu, dtype, "plain")
        assert policy is not None and policy.packed_dtype is None
    bf16 = policy_for(cpu, torch.bfloat16, "plain")
    assert bf16 is not None  # bf16 kernels are slow there: many rows upcast on the fly
    assert (bf16.upcast_min_tokens is None) == cpu_has_native_bf16()


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One layer wide enough that its weights are prepacked (PACK_MIN_ELEMENTS)."""
    return make_checkpoint(tmp_path_factory.mktemp("wide"), "llama", hidden_size=1024,
                           intermediate_size=1024, num_hidden_layers=1,
                           num_attention_heads=16, num_key_value_heads=8)


@pytest.mark.parametrize("weights", ["packed", "plain"])
async def test_a_bf16_engine_holds_its_weights_as_configured_and_serves(
        wide_llama_dir: Path, weights: str) -> None:
    engine = await start_engine(wide_llama_dir, dtype=torch.bfloat16, cpu_weights=weights)
    try:
        policy = policy_for(torch.device("cpu"), torch.bfloat16, weights)
        assert policy is not None
        model = engine.runner.model
        o_proj = model.model.layers[0].self_attn.o_proj  # 1024 x 1024: large enough
        if policy.packed_dtype is None:
            assert o_proj.packed is None and o_proj.weight.dtype == torch.bfloat16
        else:
            assert o_proj.packed is not None and o_proj.packed.dtype == policy.packed_dtype
        assert model.lm_head.packed is None  # 300 x 1024: too small to gain
        [tokens] = await generate(engine, [PROMPTS[1]])
        assert len(tokens) == GREEDY.max_tokens
    finally:
        await engine.close()


def _packs_fp32_weights() -> bool:
    """Whether an fp32 engine here holds its weights packed: where packing works, but on a
    CPU with AMX (there fp32 stays plain)."""
    policy = policy_for(torch.device("cpu"), torch.float32)
    return policy is not None and policy.packed_dtype == torch.float32


@pytest.mark.skipif(not _packs_fp32_weights(),
                    reason="this CPU holds fp32 weights plain (AMX), or cannot pack")
async def test_prepacked_fp32_weights_give_transformers_greedy_tokens(
        wide_llama_dir: Path) -> None:
    hf = hf_model(wide_llama_dir)
    engine = await start_engine(wide_llama_dir, cpu_weights="packed")
    try:
        model = engine.runner.model
        assert model.model.layers[0].mlp.down_proj.packed is not None
        prompts = PROMPTS[:3]
        assert await generate(engine, prompts) == [hf_greedy(hf, p, 32) for p in prompts]
    finally:
        await engine.close()
