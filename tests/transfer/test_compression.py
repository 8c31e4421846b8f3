"""FP8 / INT8 on the wire: the stated error bounds on random KV-like data, and the shrink."""

from __future__ import annotations

import pytest
import torch

from transfer_engine import compression
from transfer_engine.errors import InvalidTransfer


def kv_like(num_elems: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Values shaped like a KV cache: mostly small, heavy-tailed outlier channels."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_elems // 128, 128, generator=generator)
    values[:, ::17] *= 20  # outlier channels, as keys have
    return values.reshape(-1).to(dtype)


def round_trip(values: torch.Tensor, scheme: str, dtype: str,
               block_elems: int = compression.DEFAULT_BLOCK_ELEMS) -> tuple[torch.Tensor, int]:
    codec = compression.make(scheme, dtype, block_elems)
    source = memoryview(values.view(torch.uint8).numpy())
    wire_bytes = compression.compress(source, codec)
    out = torch.empty_like(values)
    compression.decompress_into(memoryview(wire_bytes), codec,
                                memoryview(out.view(torch.uint8).numpy()))
    return out, len(wire_bytes)


def block_scales(values: torch.Tensor, block_elems: int, qmax: float) -> torch.Tensor:
    blocks = values.float().view(-1, block_elems)
    return (blocks.abs().amax(dim=1) / qmax).repeat_interleave(block_elems)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_error_is_at_most_half_a_step(dtype: torch.dtype) -> None:
    values = kv_like(1 << 16, dtype)
    out, _ = round_trip(values, "int8", str(dtype).removeprefix("torch."))
    scale = block_scales(values, 256, 127.0)
    error = (out.float() - values.float()).abs()
    # Half a quantization step, plus rounding of the result to the payload's own dtype.
    bound = scale / 2 + values.float().abs() * torch.finfo(dtype).eps
    assert bool((error <= bound * 1.0001).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_error_is_within_e4m3_rounding(dtype: torch.dtype) -> None:
    values = kv_like(1 << 16, dtype, seed=1)
    out, _ = round_trip(values, "fp8", str(dtype).removeprefix("torch."))
    scale = block_scales(values, 256, 448.0)
    error = (out.float() - values.float()).abs()
    bound = values.float().abs() * (2 ** -4 + torch.finfo(dtype).eps) + scale * 2 ** -10
    assert bool((error <= bound * 1.0001).all())


@pytest.mark.parametrize(("scheme", "dtype", "shrink", "at_least"), [
    ("fp8", torch.bfloat16, 2, 1.96),  # bf16 to fp8 halves the payload ...
    ("int8", torch.float32, 4, 3.93),  # ... fp32 to int8 quarters it
])
def test_the_payload_shrinks_by_the_width_ratio(
        scheme: str, dtype: torch.dtype, shrink: int, at_least: float) -> None:
    values = kv_like(1 << 16, dtype)
    _, num_wire_bytes = round_trip(values, scheme, str(dtype).removeprefix("torch."))
    ratio = values.numel() * values.element_size() / num_wire_bytes
    # Less one float32 scale per 256-element block (1.5 %).
    assert ratio == pytest.approx(shrink / (1 + 4 / 256), rel=1e-3)
    assert ratio > at_least


def test_a_ragged_last_block_round_trips() -> None:
    values = kv_like(1024, torch.float32)[:1000]
    out, num_wire_bytes = round_trip(values, "int8", "float32", block_elems=64)
    assert num_wire_bytes == 1000 + 4 * 16
    assert (out - values).abs().max() <= values.abs().max() / 127


def test_zeros_survive_exactly() -> None:
    values = torch.zeros(512, dtype=torch.bfloat16)
    out, _ = round_trip(values, "fp8", "bfloat16")
    assert torch.equal(out, values)


def test_a_piece_that_is_not_whole_elements_is_refused() -> None:
    codec = compression.make("fp8", "bfloat16")
    with pytest.raises(InvalidTransfer, match="cannot be 3 bytes long"):
        compression.compress(memoryview(b"abc"), codec)


@pytest.mark.parametrize(("scheme", "dtype", "message"), [
    ("fp4", "bfloat16", "unknown compression 'fp4'"),
    ("fp8", "int32", "cannot compress 'int32'"),
])
def test_unknown_schemes_and_dtypes_are_refused(scheme: str, dtype: str, message: str) -> None:
    with pytest.raises(InvalidTransfer, match=message):
        compression.make(scheme, dtype)
