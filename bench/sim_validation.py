"""Does the simulator's cost model predict a real engine? Checked on this machine's CPU.

Measures this machine's peak FLOP/s (a large fp32 matmul) and memory bandwidth (streaming
read of a large tensor), builds a `SimProfile` of the model on an "accelerator" with exactly
those numbers (efficiencies 1, no step overhead: nothing fitted to the engine), then times the
real `TorchEngine` on the same model: prefill steps of several prompt lengths and decode steps
of several batch sizes. Prints predicted against measured per step and the error; the aim is
within 25 %.

    python -m bench.sim_validation [--model llama-95m|builtin]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.model_config import ModelConfig
from engine.protocol import DecodeRequest, PrefillRequest
from engine.sim_cost import Accelerator, SimProfile
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams

PROMPT_LENS = (128, 512, 1024, 2048)
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
        measured[length] = statistics.median(times[1:])  # the first warms up
    return measured


async def time_decode_steps(engine: TorchEngine, num_steps: int = 8) -> dict[int, float]:
    measured = {}
    for batch in BATCH_SIZES:
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
        measured[batch] = statistics.median(gaps)
        while engine.stats().num_running:
            await engine.next_step()
    return measured


async def validate(model_dir: Path, profile: SimProfile) -> list[tuple[str, float, float]]:
    engine = TorchEngine(EngineOptions(model_dir=model_dir, num_blocks=2048,
                                       max_batch_tokens=4096, max_batch_size=64,
                                       is_prefix_caching=False))
    await engine.start()
    try:
        prefills = await time_prefills(engine)
        decodes = await time_decode_steps(engine)
    finally:
        await engine.close()
    rows = [(f"prefill {n} tokens", profile.prefill_s([(n, 0)]), measured)
            for n, measured in prefills.items()]
    rows += [(f"decode batch {b} @ {DECODE_CONTEXT}",
              profile.decode_s([DECODE_CONTEXT + 2] * b), measured)
             for b, measured in decodes.items()]
    return rows


def model_dir_for(name: str, scratch: Path) -> Path:
    if name == "builtin":
        from engine.builtin_model import ensure_builtin_model

        return ensure_builtin_model()
    from bench.disaggregation import make_llama_95m

    return make_llama_95m(scratch / name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["llama-95m", "builtin"], default="llama-95m")
    args = parser.parse_args(argv)
    flops, bandwidth = measure_flops(), measure_bandwidth()
    print(f"this machine: {flops / 1e9:.1f} GFLOP/s fp32 (matmul 2048), "
          f"{bandwidth / 1e9:.1f} GB/s (streaming read), {torch.get_num_threads()} threads")
    cpu = Accelerator(name="this-cpu", peak_flops=flops, memory_bytes_per_s=bandwidth,
                      memory_bytes=0.0, compute_efficiency=1.0, bandwidth_efficiency=1.0)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = model_dir_for(args.model, Path(scratch))
        profile = SimProfile(args.model, ModelConfig.from_dir(model_dir), cpu, dtype_bytes=4)
        print(f"{args.model}: {profile.num_params / 1e6:.1f} M parameters", file=sys.stderr)
        rows = asyncio.run(validate(model_dir, profile))
    print(f"{'step':<24} {'predicted ms':>12} {'measured ms':>12} {'error':>8}")
    worst = 0.0
    for name, predicted, measured in rows:
        error = predicted / measured - 1
        worst = max(worst, abs(error))
        print(f"{name:<24} {1000 * predicted:12.2f} {1000 * measured:12.2f} {100 * error:7.1f}%")
    print(f"largest error {100 * worst:.1f} % (aim: within 25 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
