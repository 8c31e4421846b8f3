from __future__ import annotations

from dataclasses import replace

import pytest

from engine.sim_cost import H200, LLAMA_3_8B, PROFILES, SimProfile

EIGHT_B = PROFILES["llama-3-8b-h200"]


def test_llama_3_8b_has_its_published_size_and_kv_footprint() -> None:
    assert EIGHT_B.num_params == pytest.approx(8.03e9, rel=0.01)
    assert EIGHT_B.kv_bytes_per_token == 128 * 1024  # 2 x 32 layers x 8 heads x 128 x bf16


def test_llama_3_70b_has_its_published_size() -> None:
    assert PROFILES["llama-3-70b-h200x4"].num_params == pytest.approx(70.6e9, rel=0.01)


def test_long_prefill_is_compute_bound() -> None:
    flops = EIGHT_B.prefill_flops(8192)
    assert EIGHT_B.prefill_s([(8192, 0)]) == pytest.approx(flops / (790e12 * 0.5))


def test_attention_adds_the_quadratic_term() -> None:
    linear_part = 2 * EIGHT_B.layer_params
    doubled = EIGHT_B.prefill_flops(2000) - 2 * EIGHT_B.prefill_flops(1000)
    # (2n)(2n+1)/2 - 2 n(n+1)/2 = n^2 pairs more, each 4 x layers x heads x head_dim FLOPs.
    assert doubled == pytest.approx(4 * 32 * 32 * 128 * 1000**2 - 2 * EIGHT_B.lm_head_params)
    assert linear_part > 0


def test_cached_tokens_cost_attention_only() -> None:
    with_cache = EIGHT_B.prefill_flops(100, num_cached=1000)
    assert with_cache - EIGHT_B.prefill_flops(100) == pytest.approx(4 * 32 * 32 * 128 * 100_000)


def test_small_batch_decode_is_memory_bound_on_the_weights() -> None:
    step_s = EIGHT_B.decode_s([0])
    assert step_s == pytest.approx((EIGHT_B.weight_bytes + EIGHT_B.kv_bytes_per_token)
                                   / (4.3e12 * 0.75))
    assert 0.004 < step_s < 0.006  # ~16 GB of weights at ~3.2 TB/s


def test_decode_grows_with_the_batch_kv() -> None:
    one = EIGHT_B.decode_s([8000])
    many = EIGHT_B.decode_s([8000] * 32)
    assert many - one == pytest.approx(31 * 8001 * EIGHT_B.kv_bytes_per_token / (4.3e12 * 0.75))


def test_kv_capacity_is_device_memory_left_after_weights() -> None:
    tokens = EIGHT_B.kv_capacity_tokens()
    assert tokens == int((141e9 * 0.9 - EIGHT_B.num_params * 2) // (128 * 1024))


def test_tensor_parallel_devices_add_up() -> None:
    one = SimProfile("x1", LLAMA_3_8B, H200)
    four = SimProfile("x4", LLAMA_3_8B, replace(H200, num_devices=4))
    assert four.prefill_s([(4096, 0)]) == pytest.approx(one.prefill_s([(4096, 0)]) / 4)


def test_step_overhead_is_added_once_per_step() -> None:
    slow = SimProfile("o", LLAMA_3_8B, replace(H200, step_overhead_s=0.001))
    assert slow.decode_s([10, 10]) == pytest.approx(EIGHT_B.decode_s([10, 10]) + 0.001)


def test_a_measured_matmul_curve_is_interpolated_in_log_rows_and_clamped() -> None:
    cpu = replace(H200, matmul_flops_by_rows=((1, 10e9), (16, 50e9), (256, 90e9)))
    assert cpu.matmul_flops(1) == 10e9 and cpu.matmul_flops(1024) == 90e9
    assert cpu.matmul_flops(4) == pytest.approx(30e9)  # half-way from 1 to 16 in log rows
    assert cpu.matmul_flops(64) == pytest.approx(70e9)


def test_small_batches_pay_their_measured_matmul_rate() -> None:
    slow = replace(H200, peak_flops=1e12, memory_bytes_per_s=1e15,
                   matmul_flops_by_rows=((1, 1e9), (1024, 1e12)))
    profile = SimProfile("cpu", LLAMA_3_8B, slow)
    linear_s = 2 * (profile.layer_params + profile.lm_head_params) / 1e9
    assert profile.decode_s([0]) == pytest.approx(linear_s, rel=0.01)


def test_host_and_attention_call_overheads_count_per_sequence() -> None:
    compute_bound = replace(H200, memory_bytes_per_s=1e18)
    base = SimProfile("b", LLAMA_3_8B, compute_bound)
    profile = SimProfile("h", LLAMA_3_8B, replace(compute_bound, sequence_overhead_s=0.002,
                                                  attention_call_s=0.0001))
    extra = profile.decode_s([10] * 4) - base.decode_s([10] * 4)
    assert extra == pytest.approx(4 * (0.002 + 32 * 0.0001))


def test_measured_attention_rate_prices_the_quadratic_term() -> None:
    slow_attention = SimProfile("a", LLAMA_3_8B, replace(H200, attention_flops_per_s=1e12))
    long_prompt = [(32768, 0)]
    attention_s = EIGHT_B.attention_flops(32768, 0)
    assert (slow_attention.prefill_s(long_prompt) - EIGHT_B.prefill_s(long_prompt)
            == pytest.approx(attention_s / 1e12 - attention_s / (790e12 * 0.5)))
