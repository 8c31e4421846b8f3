"""Placement latency: prefix lookup + policy, as the conductor runs them per request.

64 prefill and 64 decode workers, a global prefix index holding `--blocks` block hashes
spread over the prefill workers (shared prefixes of varying depth), prompts of `--prompt-len`
tokens of which a random prefix is cached somewhere. Times block hashing, the index lookup and
both picks together, and prints p50/p99 per policy; the least-loaded policy (no lookup) is
the baseline measured in the same run.

    python -m bench.placement --blocks 100000 --workers 64
"""

from __future__ import annotations

import argparse
import random
import time

from services.conductor.placement import PrefixView, SeedInputs, pick_decode, pick_prefill
from services.conductor.prefix_index import PrefixIndex
from shared.block_hash import block_hashes
from shared.messages import KvBlockEvent, KvEventBatch, WorkerHeartbeat

BLOCK_SIZE = 16


def heartbeat(worker_id: str, role: str, rng: random.Random) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id, role=role, model="m", host="h",  # type: ignore[arg-type]
        num_running=rng.randrange(64), num_waiting=rng.randrange(16), max_batch_size=64,
        num_free_blocks=rng.randrange(10_000, 100_000), num_total_blocks=100_000,
        block_size=BLOCK_SIZE, heartbeat_interval_s=0.5, sent_at_s=0.0,
    )


def build(args: argparse.Namespace) -> tuple[PrefixIndex, list[list[int]], list, list]:
    rng = random.Random(0)
    prefills = [heartbeat(f"p{i:03d}", "prefill", rng) for i in range(args.workers)]
    decodes = [heartbeat(f"d{i:03d}", "decode", rng) for i in range(args.workers)]
    index = PrefixIndex()
    prompts: list[list[int]] = []
    while len(index) < args.blocks:
        prompt = [rng.randrange(30_000) for _ in range(args.prompt_len)]
        prompts.append(prompt)
        hashes = [h.hex() for h in block_hashes(prompt, BLOCK_SIZE)]  # as on the wire
        for holder in rng.sample(prefills, 3):
            depth = rng.randrange(1, len(hashes) + 1)
            index.apply(KvEventBatch(worker_id=holder.worker_id, block_size=BLOCK_SIZE, events=[
                KvBlockEvent(kind="stored", block_hash=h) for h in hashes[:depth]]))
    return index, prompts, prefills, decodes


def place(policy: str, prompt: list[int], index: PrefixIndex, prefills: list,
          decodes: list, turn: int) -> None:
    prefix = None
    seed = SeedInputs(num_prompt_tokens=len(prompt), block_size=BLOCK_SIZE)
    if policy in ("cache-aware", "seed"):
        hashes = block_hashes(prompt, BLOCK_SIZE)
        prefix = PrefixView(len(hashes), index.leading_blocks(
            hashes, [w.worker_id for w in prefills]))
    pick_prefill(prefills, (), {}, policy=policy, prefix=prefix, turn=turn,  # type: ignore[arg-type]
                 seed=seed)
    pick_decode(decodes, (), {}, len(prompt) + 256)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    index, prompts, prefills, decodes = build(args)
    print(f"{len(index)} indexed blocks, {args.workers} prefill + {args.workers} decode "
          f"workers, prompts of {args.prompt_len} tokens")
    rng = random.Random(1)
    results = {}
    for policy in ("least-loaded", "round-robin", "cache-aware", "seed"):
        times = []
        for turn in range(args.requests):
            prompt = rng.choice(prompts)
            started = time.perf_counter()
            place(policy, prompt, index, prefills, decodes, turn)
            times.append(time.perf_counter() - started)
        times.sort()
        results[policy] = (times[len(times) // 2] * 1e3, times[int(len(times) * 0.99)] * 1e3)
    base = results["least-loaded"][1]
    print(f"{'policy':<14} {'p50 ms':>8} {'p99 ms':>8} {'p99 vs least-loaded':>20}")
    for policy, (p50, p99) in results.items():
        print(f"{policy:<14} {p50:>8.3f} {p99:>8.3f} {p99 / base:>19.1f}x")


if __name__ == "__main__":
    main()
