"""KV memory: how many requests run at once, and how fast, at one fixed KV budget, when
blocks are taken as sequences grow (preempting by recompute when short) against the engine's
earlier up-front reservation of prompt + `max_tokens`.

The workload is what makes reservation wasteful: every request asks for `max_tokens` four
times the output it really produces (its output ends early, as a stop string ends it: the
benchmark aborts it then, as the decode worker does for the gateway). All requests arrive at
once; each policy serves them all on the same model and pool, alternating rounds, in one run.

    python -m bench.kv_memory [--requests 96 --num-blocks 256 --output 32 --rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.model_config import ModelConfig
from engine.protocol import PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams

POLICIES = ("up-front", "growth")


@dataclass
class Round:
    policy: str
    mean_running: float
    peak_running: int
    tokens_per_s: float
    preemptions: int


async def serve(model_dir: Path, policy: str, prompts: list[list[int]], args: argparse.Namespace
                ) -> Round:
    engine = TorchEngine(EngineOptions(
        model_dir=model_dir, num_blocks=args.num_blocks, block_size=16,
        max_batch_size=len(prompts), max_batch_tokens=2048, max_wait_s=0.0,
        kv_reservation=policy))
    await engine.start()
    try:
        sampling = SamplingParams(max_tokens=4 * args.output, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.generate(PrefillRequest(f"r{i}", prompt, sampling))
        produced = dict.fromkeys((f"r{i}" for i in range(len(prompts))), 0)
        running: list[int] = []
        while any(n < args.output for n in produced.values()):
            outputs = await engine.next_step()
            running.append(engine.stats().num_running)
            for out in outputs:
                assert out.error is None, out.error
                if produced[out.request_id] < args.output:
                    produced[out.request_id] += 1
                    if produced[out.request_id] == args.output:
                        engine.abort(out.request_id)  # its stop string matched
        elapsed = time.perf_counter() - started
        return Round(policy, statistics.mean(running), max(running),
                     sum(produced.values()) / elapsed, engine.stats().num_preemptions)
    finally:
        await engine.close()


async def run(args: argparse.Namespace) -> None:
    from engine.builtin_model import write_builtin_model

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_builtin_model(Path(tmp) / "tiny")
        vocab_size = ModelConfig.from_dir(model_dir).vocab_size
        prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randrange(64, 193))]
                   for _ in range(args.requests)]
        rounds = [await serve(model_dir, policy, prompts, args)
                  for _ in range(args.rounds) for policy in POLICIES]
    print(f"{args.requests} requests at once, prompts 64-192 tokens, output {args.output} "
          f"tokens of max_tokens {4 * args.output}; pool {args.num_blocks} blocks of 16 "
          f"tokens; built-in model, fp32, {args.rounds} rounds per policy")
    def mean(policy: str, field: str) -> float:
        return statistics.mean(getattr(r, field) for r in rounds if r.policy == policy)

    print(f"{'policy':<10} {'mean running':>13} {'peak running':>13} {'output tok/s':>13} "
          f"{'preemptions':>12}")
    for policy in POLICIES:
        mine = [r for r in rounds if r.policy == policy]
        print(f"{policy:<10} {mean(policy, 'mean_running'):>13.1f} "
              f"{max(r.peak_running for r in mine):>13} {mean(policy, 'tokens_per_s'):>13.1f} "
              f"{mean(policy, 'preemptions'):>12.0f}")
    print(f"growth / up-front: concurrent requests "
          f"{mean('growth', 'mean_running') / mean('up-front', 'mean_running'):.2f}x, "
          f"throughput {mean('growth', 'tokens_per_s') / mean('up-front', 'tokens_per_s'):.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--output", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
