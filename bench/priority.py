"""What priority scheduling buys an urgent request when the server is busy.

Starts `halfmoon up` on the built-in model with `--scheduling-policy priority` and a small
`--max-batch-size` (a server whose decode steps cannot take every request at once), unless
`--url` names a running one started so. Each round sends a burst of `--requests` streamed
greedy completions, one in every `--urgent-every` marked urgent; the rounds alternate
between sending the marked ones at priority `--urgent-priority` and at 0 (the baseline: the
same requests, the same stack, in the same run). Prints TTFT and end-to-end latency per
class and mode, and each class's latency with priorities over its baseline.

    python -m bench.priority [--requests 64 --urgent-every 8 --rounds 4 --max-batch-size 8]
                             [--num-blocks N]

`--num-blocks` gives each worker a KV pool of N blocks: a server short of KV rather than of
batch slots, where an urgent request takes blocks from running ones.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import aiohttp

from bench.control_path import MODEL, launched
from bench.results import percentile


@dataclass
class Latencies:
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)

    def p(self, q: float) -> tuple[float, float]:
        """The q-quantiles (0..1) of TTFT and end-to-end latency, in ms."""
        return percentile(self.ttft_s, q) * 1000, percentile(self.e2e_s, q) * 1000


async def one(session: aiohttp.ClientSession, url: str, index: int, priority: int,
              max_tokens: int) -> tuple[float, float]:
    """(TTFT, end-to-end) seconds of one streamed completion."""
    body = {"model": MODEL, "prompt": f"request {index} tells the story of",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "priority": priority}
    started = time.perf_counter()
    ttft = None
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
    return ttft or 0.0, time.perf_counter() - started


async def burst(url: str, args: argparse.Namespace, num_requests: int, urgent_priority: int,
                results: dict[str, Latencies]) -> None:
    """One burst, its requests a couple of ms apart; latencies into `results` by class."""
    async with aiohttp.ClientSession() as session:
        sent = []
        for index in range(num_requests):
            is_urgent = index % args.urgent_every == args.urgent_every - 1
            priority = urgent_priority if is_urgent else 0
            sent.append((is_urgent, asyncio.create_task(
                one(session, url, index, priority, args.max_tokens))))
            await asyncio.sleep(0.002)
        for is_urgent, task in sent:
            ttft, e2e = await task
            latencies = results["urgent" if is_urgent else "other"]
            latencies.ttft_s.append(ttft)
            latencies.e2e_s.append(e2e)


async def run(url: str, args: argparse.Namespace) -> dict[str, dict[str, Latencies]]:
    """Latencies by mode ("priority", "baseline") and class ("urgent", "other")."""
    modes = {mode: _classes() for mode in ("priority", "baseline", "warm-up")}
    await burst(url, args, 4, 0, modes.pop("warm-up"))
    for round_ in range(args.rounds):
        order = ("priority", "baseline") if round_ % 2 == 0 else ("baseline", "priority")
        for mode in order:
            await burst(url, args, args.requests,
                        args.urgent_priority if mode == "priority" else 0, modes[mode])
    return modes


def _classes() -> dict[str, Latencies]:
    return {"urgent": Latencies(), "other": Latencies()}


def print_table(modes: dict[str, dict[str, Latencies]]) -> None:
    print(f"{'class':>7} {'mode':>9} {'n':>4} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'E2E p50':>9} {'E2E p90':>9} {'E2E p50 / baseline':>19}")
    for name in ("urgent", "other"):
        base_e2e = modes["baseline"][name].p(0.5)[1]
        for mode in ("priority", "baseline"):
            latencies = modes[mode][name]
            (ttft50, e2e50), (ttft90, e2e90) = latencies.p(0.5), latencies.p(0.9)
            print(f"{name:>7} {mode:>9} {len(latencies.e2e_s):>4} {ttft50:>7.0f}ms "
                  f"{ttft90:>7.0f}ms {e2e50:>7.0f}ms {e2e90:>7.0f}ms "
                  f"{e2e50 / base_e2e:>18.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None,
                        help="a running halfmoon gateway with --scheduling-policy priority")
    parser.add_argument("--requests", type=int, default=64, help="per burst")
    parser.add_argument("--urgent-every", type=int, default=8)
    parser.add_argument("--urgent-priority", type=int, default=-1)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=4, help="bursts per mode")
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="each worker's KV pool, in blocks (default: halfmoon up's)")
    args = parser.parse_args()
    if args.url:
        modes = asyncio.run(run(args.url, args))
    else:
        pool = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
        with launched("--scheduling-policy", "priority", "--max-batch-size",
                      str(args.max_batch_size), *pool, "--log-level", "warning") as (_, url):
            modes = asyncio.run(run(url, args))
    print_table(modes)


if __name__ == "__main__":
    main()
