"""The CPU GEMM policy's kernels give what `F.linear` gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.linear import CpuGemmPolicy, Linear, policy_for, prepacking_works

PREPACKING = pytest.mark.skipif(not prepacking_works(),
                                reason="this CPU or torch build has no prepacked bf16 linear")


@PREPACKING
@pytest.mark.parametrize("num_rows", [1, 5, 40, 300])
def test_a_prepacked_bf16_linear_equals_the_plain_one_and_keeps_one_copy(
        num_rows: int) -> None:
    torch.manual_seed(num_rows)
    layer = Linear(64, 96, bias=True).to(torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.set_policy(CpuGemmPolicy(None, 1024, is_prepacked=True))
    x = torch.randn(num_rows, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert layer.weight.numel() == 0  # the plain weight is freed, not kept beside the packed


@PREPACKING
def test_bf16_weights_are_prepacked_on_a_cpu_with_bf16_units_and_fp32_ones_are_not() -> None:
    cpu = torch.device("cpu")
    assert policy_for(cpu, torch.bfloat16) == CpuGemmPolicy(None, 1024, is_prepacked=True)
    assert not policy_for(cpu, torch.float32).is_prepacked  # type: ignore[union-attr]
