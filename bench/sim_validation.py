"""Does the simulator's cost model predict a real engine? Checked on this machine's CPU.

Measures this machine with microbenchmarks of its kernels, never of the engine: peak FLOP/s
(a 2048^3 fp32 matmul), memory bandwidth (streaming read of 1 GiB), the achieved FLOP/s of
one model layer's matmuls at several token-row counts (the engine's CPU GEMM, on the model's
weight shapes: small-batch GEMMs on a CPU reach neither peak), and the time of one decode
attention call. It builds a `SimProfile` of the model on an "accelerator" with exactly those
numbers (efficiencies 1, no step overhead), then times the real `TorchEngine` on the same
model: prefill steps of several prompt lengths and decode steps of several batch sizes.
Every figure, microbenchmark or engine step, is the best of several runs, and the machine
and the engine are measured in turn for `--rounds` rounds: on a shared machine noise only
ever adds time, and a slow spell should not fall on one side only.
Prints predicted against measured per step, and the prediction of the plain roofline (peak
FLOP/s and bandwidth only) beside it; the aim is within 25 %.

    python -m bench.sim_validation [--model llama-95m|builtin]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, SequenceSlice, TorchAttention
from engine.kv_cache import KvCache
from engine.linear import Linear, policy_for
from engine.model_config import ModelConfig
from engine.protocol import DecodeRequest, PrefillRequest
from engine.sim_cost import Accelerator, SimProfile
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams

PROMPT_LENS = (128, 512, 1024, 1536)
BATCH_SIZES = (1, 8, 32)
DECODE_CONTEXT = 256


def measure_flops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)  # warm-up
    best = min(_timed(lambda: torch.matmul(a, b)) for _ in range(repeats))
    return 2 * size**3 / best


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    data = torch.ones(num_bytes // 4)
    data.sum()
    best = min(_timed(data.sum) for _ in range(repeats))
    return num_bytes / best


def measure_matmul_curve(config: ModelConfig, rows: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
                         ) -> tuple[tuple[int, float], ...]:
    """Achieved FLOP/s of the layers' matmuls (fused qkv, o, fused gate/up, down, of every
    layer: distinct weights, as cold in cache as in a real step) at each row count, through
    the engine's CPU GEMM policy."""
    q_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    shapes = [(q_out, config.hidden_size), (config.hidden_size, config.num_heads * config.head_dim),
              (2 * config.intermediate_size, config.hidden_size),
              (config.hidden_size, config.intermediate_size)]
    policy = policy_for(torch.device("cpu"), torch.float32)
    weights = []
    for _ in range(config.num_layers):
        for out, inp in shapes:
            layer = Linear(inp, out, bias=False)
            layer.weight.data.normal_()
            layer.set_policy(policy)  # prepacked where the engine prepacks
            weights.append(layer)
    curve = []
    for num_rows in rows:
        inputs = {w.in_features: torch.randn(num_rows, w.in_features) for w in weights}

        def layers(inputs: dict[int, torch.Tensor] = inputs) -> None:
            with torch.inference_mode():
                for w in weights:
                    w(inputs[w.in_features])

        layers()
        seconds = min(_timed(layers) for _ in range(3))
        flops = sum(2 * num_rows * w.in_features * w.out_features for w in weights)
        curve.append((num_rows, flops / seconds))
    return tuple(curve)


def _one_sequence_attention(config: ModelConfig, context_len: int, query_len: int
                            ) -> Callable[[], object]:
    """One sequence's attention as the engine runs it (`TorchAttention`: plan and one call
    over its context, gathered from scattered blocks of the paged pool)."""
    num_blocks = 4 * -(-context_len // 16)
    kv = KvCache(num_layers=1, num_blocks=num_blocks, block_size=16,
                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                 dtype=torch.float32, device=torch.device("cpu"))
    blocks = torch.randperm(num_blocks)[:-(-context_len // 16)].tolist()
    meta = AttentionMetadata(torch.zeros(query_len, dtype=torch.long),
                             [SequenceSlice(0, query_len, context_len, blocks)])
    backend = TorchAttention(torch.device("cpu"))
    q = torch.randn(query_len, config.num_heads, config.head_dim)
    return lambda: backend.attend(q, kv, 0, backend.plan(meta, kv))


def measure_attention_call(config: ModelConfig, context_len: int = DECODE_CONTEXT) -> float:
    """One decode attention call as the engine makes it: gather one sequence's context from
    the paged KV pool, attend one query over it."""
    call = _one_sequence_attention(config, context_len, 1)
    call()
    return min(_timed(call) for _ in range(200))


def measure_attention_flops(config: ModelConfig, num_tokens: int = 1024) -> float:
    """Achieved FLOP/s of causal attention over a prompt of `num_tokens` (one layer)."""
    call = _one_sequence_attention(config, num_tokens, num_tokens)
    call()
    seconds = min(_timed(call) for _ in range(5))
    pairs = num_tokens * (num_tokens + 1) / 2
    return 4 * config.num_heads * config.head_dim * pairs / seconds


async def measure_host_overhead(null_model_dir: Path) -> tuple[float, float]:
    """(per step, per sequence) host time: decode steps of a model too small to compute
    anything (the model's depth at width 64, the same vocabulary: the same operations to
    dispatch), at batch 1 and 32."""
    engine = TorchEngine(EngineOptions(model_dir=null_model_dir, num_blocks=2048,
                                       is_prefix_caching=False))
    await engine.start()
    try:
        steps = await time_decode_steps(engine, batch_sizes=(1, 32), num_steps=20)
    finally:
        await engine.close()
    per_sequence = max(0.0, (steps[32] - steps[1]) / 31)
    return max(0.0, steps[1] - per_sequence), per_sequence


def _timed(work) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def prompt(length: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 31) % 250 + 3 for i in range(length)]


async def time_prefills(engine: TorchEngine, repeats: int = 3) -> dict[int, float]:
    measured = {}
    for length in PROMPT_LENS:
        times = []
        for i in range(repeats + 1):
            request_id = f"p{length}-{i}"
            result = await engine.prefill(PrefillRequest(
                request_id, prompt(length, i), SamplingParams(max_tokens=1)))
            engine.release(request_id)
            times.append(result.compute_s)
        measured[length] = min(times[1:])  # the first warms up; best of: noise only adds
    return measured


async def time_decode_steps(engine: TorchEngine, batch_sizes: tuple[int, ...] = BATCH_SIZES,
                            num_steps: int = 8) -> dict[int, float]:
    measured = {}
    for batch in batch_sizes:
        sampling = SamplingParams(max_tokens=num_steps + 4, ignore_eos=True)
        for i in range(batch):
            request_id = f"d{batch}-{i}"
            engine.reserve(request_id, DECODE_CONTEXT + sampling.max_tokens)
            engine.join(DecodeRequest(request_id, prompt(DECODE_CONTEXT, i), 5, sampling))
        stamps = []
        while len(stamps) < num_steps + 2:
            await engine.next_step()
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in itertools.pairwise(stamps[1:])]
        measured[batch] = min(gaps)
        while engine.stats().num_running:
            await engine.next_step()
    return measured


async def time_engine(model_dir: Path) -> dict[tuple[str, int], float]:
    """Measured step times: ("prefill", prompt tokens) and ("decode", batch size)."""
    engine = TorchEngine(EngineOptions(model_dir=model_dir, num_blocks=2048,
                                       max_batch_tokens=4096, max_batch_size=64,
                                       is_prefix_caching=False))
    await engine.start()
    try:
        prefills = await time_prefills(engine)
        decodes = await time_decode_steps(engine)
    finally:
        await engine.close()
    return ({("prefill", n): s for n, s in prefills.items()}
            | {("decode", b): s for b, s in decodes.items()})


def predict(profile: SimProfile, kind: str, size: int) -> float:
    if kind == "prefill":
        return profile.prefill_s([(size, 0)])
    return profile.decode_s([DECODE_CONTEXT + 2] * size)


def best_of(devices: list[Accelerator]) -> Accelerator:
    """Field by field, the fastest any round measured: noise on a shared machine only ever
    slows a measurement down."""
    first = devices[0]
    curve = tuple((rows, max(d.matmul_flops_by_rows[i][1] for d in devices))
                  for i, (rows, _) in enumerate(first.matmul_flops_by_rows))
    return replace(first, peak_flops=max(d.peak_flops for d in devices),
                   memory_bytes_per_s=max(d.memory_bytes_per_s for d in devices),
                   matmul_flops_by_rows=curve,
                   attention_flops_per_s=max(d.attention_flops_per_s for d in devices),
                   attention_call_s=min(d.attention_call_s for d in devices),
                   step_overhead_s=min(d.step_overhead_s for d in devices),
                   sequence_overhead_s=min(d.sequence_overhead_s for d in devices))


def model_dir_for(name: str, scratch: Path) -> Path:
    if name == "builtin":
        from engine.builtin_model import ensure_builtin_model

        return ensure_builtin_model()
    from bench.disaggregation import make_llama_95m

    return make_llama_95m(scratch / name)


def measure_machine(config: ModelConfig, scratch: Path) -> Accelerator:
    """This machine for this model, with every measured refinement."""
    from bench.disaggregation import make_llama

    roofline = Accelerator(name="this-cpu", peak_flops=measure_flops(),
                           memory_bytes_per_s=measure_bandwidth(), memory_bytes=0.0,
                           compute_efficiency=1.0, bandwidth_efficiency=1.0)
    null_model = make_llama(scratch / "null", hidden_size=64, intermediate_size=64,
                            num_layers=config.num_layers, num_heads=1, num_kv_heads=1)
    step_s, sequence_s = asyncio.run(measure_host_overhead(null_model))
    return replace(roofline, matmul_flops_by_rows=measure_matmul_curve(config),
                   attention_call_s=measure_attention_call(config),
                   attention_flops_per_s=measure_attention_flops(config),
                   step_overhead_s=step_s, sequence_overhead_s=sequence_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama-95m", "builtin"], default="llama-95m")
    parser.add_argument("--rounds", type=int, default=3,
                        help="machine and engine measured in turn, this many times")
    args = parser.parse_args(argv)
    devices, timings = [], []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = model_dir_for(args.model, Path(scratch))
        config = ModelConfig.from_dir(model_dir)
        # Interleaved, so that a slow spell of the machine hits both sides alike.
        for _ in range(args.rounds):
            devices.append(measure_machine(config, Path(scratch)))
            timings.append(asyncio.run(time_engine(model_dir)))
    measured = best_of(devices)
    plain = replace(measured, matmul_flops_by_rows=(), attention_call_s=0.0,
                    attention_flops_per_s=0.0, step_overhead_s=0.0, sequence_overhead_s=0.0)
    profile = SimProfile(args.model, config, measured, dtype_bytes=4)
    roofline = SimProfile(args.model, config, plain, dtype_bytes=4)
    print(describe(profile))
    print(f"{'step':<24} {'predicted ms':>12} {'measured ms':>12} {'error':>8} "
          f"{'plain roofline':>15}")
    worst = 0.0
    for kind, size in timings[0]:
        measured_s = min(t[(kind, size)] for t in timings)
        predicted, plain_s = predict(profile, kind, size), predict(roofline, kind, size)
        error = predicted / measured_s - 1
        worst = max(worst, abs(error))
        name = f"prefill {size} tokens" if kind == "prefill" else \
            f"decode batch {size} @ {DECODE_CONTEXT}"
        print(f"{name:<24} {1000 * predicted:12.2f} {1000 * measured_s:12.2f} "
              f"{100 * error:7.1f}% {100 * (plain_s / measured_s - 1):14.1f}%")
    print(f"largest error {100 * worst:.1f} % (aim: within 25 %)")
    return 0


def describe(profile: SimProfile) -> str:
    device = profile.accelerator
    curve = ", ".join(f"{rows}: {flops / 1e9:.1f}" for rows, flops in
                      device.matmul_flops_by_rows)
    return (f"this machine ({torch.get_num_threads()} threads): peak {device.peak_flops / 1e9:.1f}"
            f" GFLOP/s fp32, {device.memory_bytes_per_s / 1e9:.1f} GB/s streaming read; "
            f"layer matmuls GFLOP/s by rows {{{curve}}}; attention "
            f"{device.attention_flops_per_s / 1e9:.1f} GFLOP/s, a decode call "
            f"{1e6 * device.attention_call_s:.0f} us; host per step "
            f"{1e3 * device.step_overhead_s:.2f} ms + {1e3 * device.sequence_overhead_s:.2f} ms "
            f"per sequence\n{profile.name}: "
            f"{profile.num_params / 1e6:.1f} M parameters")


if __name__ == "__main__":
    sys.exit(main())
