from __future__ import annotations

from dataclasses import replace

from bench.sim_validation import best_of
from engine.sim_cost import Accelerator

SLOW = Accelerator(name="cpu", peak_flops=80e9, memory_bytes_per_s=15e9, memory_bytes=0.0,
                   matmul_flops_by_rows=((1, 5e9), (16, 30e9)), attention_call_s=3e-4,
                   attention_flops_per_s=50e9, step_overhead_s=4e-3, sequence_overhead_s=1e-3)


def test_rounds_combine_to_the_fastest_each_measured() -> None:
    other = replace(SLOW, peak_flops=100e9, memory_bytes_per_s=12e9,
                    matmul_flops_by_rows=((1, 6e9), (16, 20e9)), attention_call_s=2e-4,
                    step_overhead_s=5e-3, sequence_overhead_s=0.5e-3)
    best = best_of([SLOW, other])
    assert (best.peak_flops, best.memory_bytes_per_s) == (100e9, 15e9)
    assert best.matmul_flops_by_rows == ((1, 6e9), (16, 30e9))
    assert (best.attention_call_s, best.attention_flops_per_s) == (2e-4, 50e9)
    assert (best.step_overhead_s, best.sequence_overhead_s) == (4e-3, 0.5e-3)
