"""The CPU GEMM policy's kernels give what `F.linear` gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.linear import (
    CpuGemmPolicy,
    Linear,
    cpu_has_native_bf16,
    cpu_weights_for,
    policy_for,
    prepacking_works,
)
from tests.engine.test_against_transformers import GREEDY, PROMPTS, generate, start_engine


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
    layer.set_policy(CpuGemmPolicy(None, 1024, torch.bfloat16))
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
    layer.set_policy(CpuGemmPolicy(None, 1024, torch.float32))
    x = torch.randn(num_rows, 64).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    # oneDNN sums in another order than MKL: equal within fp32 rounding, then cast alike.
    expected = F.linear(x.float(), weight, bias)
    assert torch.allclose(out.float(), expected.to(dtype).float(), rtol=1e-2 if dtype ==
                          torch.bfloat16 else 1e-5, atol=1e-5)
    assert layer.weight.numel() == 0


def test_each_cpu_holds_its_weights_as_measured_fastest_there() -> None:
    cpu = torch.device("cpu")
    bf16, fp32 = policy_for(cpu, torch.bfloat16), policy_for(cpu, torch.float32)
    assert bf16 is not None and fp32 is not None
    if cpu_has_native_bf16():
        assert bf16.packed_dtype == (torch.bfloat16 if prepacking_works(torch.bfloat16)
                                     else None)
        assert fp32.packed_dtype is None
    elif prepacking_works(torch.float32):  # fp32 in oneDNN's layout for both
        assert bf16 == fp32 == CpuGemmPolicy(None, 1024, torch.float32)
    else:  # bf16 upcast on the fly for many rows
        assert bf16.upcast_min_tokens is not None and fp32.upcast_min_tokens is None
    assert policy_for(torch.device("meta"), torch.float32) is None


def test_plain_weights_stay_as_loaded() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        policy = policy_for(cpu, dtype, "plain")
        assert policy is not None and policy.packed_dtype is None
    bf16 = policy_for(cpu, torch.bfloat16, "plain")
    assert bf16 is not None  # bf16 kernels are slow there: many rows upcast on the fly
    assert (bf16.upcast_min_tokens is None) == cpu_has_native_bf16()


def test_auto_keeps_plain_weights_only_for_prefill_on_a_cpu_without_bf16_units() -> None:
    assert cpu_weights_for("auto", "decode") == "packed"
    assert cpu_weights_for("auto", "prefill") == ("packed" if cpu_has_native_bf16()
                                                  else "plain")
    assert cpu_weights_for("plain", "decode") == "plain"
    assert cpu_weights_for("packed", "prefill") == "packed"


@pytest.mark.parametrize("weights", ["packed", "plain"])
async def test_a_bf16_engine_holds_its_weights_as_configured_and_serves(
        llama_dir: Path, weights: str) -> None:
    engine = await start_engine(llama_dir, dtype=torch.bfloat16, cpu_weights=weights)
    try:
        policy = policy_for(torch.device("cpu"), torch.bfloat16, weights)
        assert policy is not None
        qkv = engine._runner.model.model.layers[0].self_attn.qkv_proj  # type: ignore[union-attr]
        if policy.packed_dtype is None:
            assert qkv.packed is None and qkv.weight.dtype == torch.bfloat16
        else:
            assert qkv.packed is not None and qkv.packed.dtype == policy.packed_dtype
        [tokens] = await generate(engine, [PROMPTS[1]])
        assert len(tokens) == GREEDY.max_tokens
    finally:
        await engine.close()
