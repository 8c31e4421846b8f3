"""Placement policies on a real trace: prefix-cache hit ratio, TTFT and rejections.

For each policy, starts `halfmoon up` (every service its own process, embedded NATS) with
`--prefill` prefill and `--decode` decode workers on the fake engine with a cost model
(prefill: `--prefill-s-per-token` per uncached prompt token plus a per-batch overhead; decode:
`--token-delay-s` per step) and a prefix cache of `--num-blocks` blocks per worker, then
replays the Mooncake trace (`bench/trace.py`: lengths, outputs and time scaled) as streaming
completions at the trace's arrival times (open loop). The hit ratio is the prompt tokens that
the prefix cache served (`usage.prompt_tokens_details.cached_tokens`) over all prompt tokens.

Policies: round-robin, least-loaded, cache-aware, seed, and longest-prefix, the oracle (the
worker holding the longest cached prefix, whatever its load). Ratios are against the oracle's
hit ratio and least-loaded's TTFT p99 of the same run.

    python -m bench.prefix_policies --limit 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.control_path import launched
from bench.results import percentile
from bench.trace import DEFAULT_TRACE, TraceRequest, TraceScaling, load_trace

MODEL = "halfmoon-tiny"
POLICIES = ("round-robin", "least-loaded", "cache-aware", "seed", "longest-prefix")


@dataclass
class Outcome:
    status: int  # HTTP status; 0 when the connection failed
    ttft_s: float = float("nan")
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    num_requests: int
    num_ok: int
    num_rejected: int  # 429: SLO admission or no KV room
    num_errors: int
    hit_ratio: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    wall_s: float


async def one_request(session: aiohttp.ClientSession, url: str, request: TraceRequest
                      ) -> Outcome:
    body = {"model": MODEL, "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    outcome = Outcome(status=0)
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            outcome.status = response.status
            if response.status != 200:
                await response.read()
                return outcome
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                if outcome.ttft_s != outcome.ttft_s:  # nan: the first chunk
                    outcome.ttft_s = time.perf_counter() - started
                payload = json.loads(line[6:])
                if "error" in payload:
                    outcome.status = 500
                if usage := payload.get("usage"):
                    outcome.num_prompt_tokens = usage["prompt_tokens"]
                    outcome.num_cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    except aiohttp.ClientError:
        outcome.status = 0
    return outcome


async def replay(url: str, requests: list[TraceRequest]) -> tuple[list[Outcome], float]:
    """Send each request at its arrival time; return the outcomes and the wall time."""
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()

        async def at_arrival(request: TraceRequest) -> Outcome:
            await asyncio.sleep(max(0.0, started + request.arrival_s - time.perf_counter()))
            return await one_request(session, url, request)

        outcomes = await asyncio.gather(*(at_arrival(r) for r in requests))
        return list(outcomes), time.perf_counter() - started


def summarize(policy: str, outcomes: list[Outcome], wall_s: float) -> PolicyResult:
    ok = [o for o in outcomes if o.status == 200]
    ttfts = [o.ttft_s for o in ok]
    prompt_tokens = sum(o.num_prompt_tokens for o in ok)
    return PolicyResult(
        policy=policy, num_requests=len(outcomes), num_ok=len(ok),
        num_rejected=sum(o.status == 429 for o in outcomes),
        num_errors=sum(o.status not in (200, 429) for o in outcomes),
        hit_ratio=sum(o.num_cached_tokens for o in ok) / max(1, prompt_tokens),
        ttft_p50_ms=1000 * percentile(ttfts, 0.5), ttft_p99_ms=1000 * percentile(ttfts, 0.99),
        wall_s=wall_s,
    )


def ideal_hit_ratio(requests: list[TraceRequest], block_tokens: int) -> float:
    """Prompt tokens in blocks seen before (an infinite cache shared by all workers)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for request in requests:
        num_full = len(request.prompt_token_ids) // block_tokens
        for depth in range(num_full):
            prefix = request.hash_ids[:depth + 1]
            hits += block_tokens if prefix in seen else 0
            seen.add(prefix)
        total += len(request.prompt_token_ids)
    return hits / max(1, total)


def run_policy(policy: str, requests: list[TraceRequest], args: argparse.Namespace
               ) -> PolicyResult:
    up_args = ["--engine", "fake", "--log-level", "warning", "--policy", policy,
               "--prefill", str(args.prefill), "--decode", str(args.decode),
               "--fake-prefill-s-per-token", str(args.prefill_s_per_token),
               "--fake-prefill-delay-s", str(args.prefill_overhead_s),
               "--fake-token-delay-s", str(args.token_delay_s),
               "--num-blocks", str(args.num_blocks), "--max-model-len", str(args.max_model_len)]
    if args.ttft_slo_ms is not None:
        up_args += ["--ttft-slo-ms", str(args.ttft_slo_ms)]
    with launched(*up_args) as (_, url):
        outcomes, wall_s = asyncio.run(replay(url, requests))
    return summarize(policy, outcomes, wall_s)


def print_table(results: list[PolicyResult], ideal: float) -> None:
    by_policy = {r.policy: r for r in results}
    oracle = by_policy.get("longest-prefix")
    least = by_policy.get("least-loaded")
    print(f"{'policy':>15} {'ok':>5} {'429':>4} {'err':>4} {'hit ratio':>9} "
          f"{'x oracle':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'p99 x LL':>8}")
    for r in results:
        vs_oracle = f"{r.hit_ratio / oracle.hit_ratio:.2f}" if oracle and oracle.hit_ratio else "-"
        vs_least = f"{r.ttft_p99_ms / least.ttft_p99_ms:.2f}" if least else "-"
        print(f"{r.policy:>15} {r.num_ok:>5} {r.num_rejected:>4} {r.num_errors:>4} "
              f"{r.hit_ratio:>9.3f} {vs_oracle:>8} {r.ttft_p50_ms:>7.0f}ms "
              f"{r.ttft_p99_ms:>7.0f}ms {vs_least:>8}")
    print(f"(an infinite cache shared by every worker would hit {ideal:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--prefill", type=int, default=4)
    parser.add_argument("--decode", type=int, default=4)
    parser.add_argument("--length-divisor", type=int, default=32)
    parser.add_argument("--output-divisor", type=int, default=4)
    parser.add_argument("--time-divisor", type=float, default=8.0)
    parser.add_argument("--prefill-s-per-token", type=float, default=0.0002)
    parser.add_argument("--prefill-overhead-s", type=float, default=0.005)
    parser.add_argument("--token-delay-s", type=float, default=0.02)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--ttft-slo-ms", type=float, default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    scaling = TraceScaling(args.length_divisor, args.output_divisor, args.time_divisor)
    requests = [r for r in load_trace(args.trace, scaling, args.limit)
                if len(r.prompt_token_ids) + r.max_tokens < args.max_model_len]
    print(f"{len(requests)} requests over {requests[-1].arrival_s:.0f} s, block "
          f"{scaling.block_tokens} tokens", file=sys.stderr)
    results = []
    for policy in args.policies.split(","):
        results.append(run_policy(policy, requests, args))
        print(f"{policy}: {results[-1]}", file=sys.stderr)
    print_table(results, ideal_hit_ratio(requests, scaling.block_tokens))
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump([asdict(r) for r in results], out, indent=2)


if __name__ == "__main__":
    main()
