"""Chaos: one fault per run under a fixed streaming greedy load, every client's output
compared with a fault-free run.

For each scenario, a fresh `halfmoon up --engine fake` (every service its own process,
embedded NATS, supervised), `--clients` streaming clients sending `--requests` greedy
completions of `--max-tokens` tokens in all; `--fault-at-s` into the load, one fault:

    none             no fault: the reference outputs and TTFTs
    kill-prefill     SIGKILL a prefill worker (the launcher restarts it)
    kill-decode      SIGKILL a decode worker
    kill-conductor   SIGKILL the conductor
    stop-prefill     SIGSTOP a prefill worker (frozen mid-work), SIGKILL it 2 s later
    pause-decode     SIGSTOP a decode worker for 3 s (past the heartbeat timeout), then
                     SIGCONT: it comes back to requests moved elsewhere
    pause-prefill    the same for a prefill worker
    pause-conductor  SIGSTOP the conductor for 6 s (past the request stream's 5 s ack
                     wait), then SIGCONT: what it was placing is delivered again
    restart-nats     SIGKILL the embedded nats-server (the launcher restarts it, same store)
    kill-gateway     SIGKILL one of the two gateways: only its own clients may be affected
                     (counted apart, as `own`); the other gateway's must all complete

`--launch up` (default) starts everything as `halfmoon up --gateways 2` (supervised);
`--launch processes` starts each service by hand as its own process (2 conductors, 2
prefill, 2 decode, 2 gateways, no supervisor: a killed process stays dead).
`--engine torch` (with `--launch up`) runs the built-in model instead of the fake engine,
and `--long-prompts` sends prompts of 40 to 450 words (about 160 to 1800 tokens of the
built-in model) instead of short ones, so a fault meets real prefill and KV handoffs.

Columns: requests, completed (200 and exactly the reference text), truncated (200, a prefix
of it), wrong (200, anything else), errors by HTTP status, missing and duplicated tokens
(against the reference; bytes of text with the torch engine), KV blocks and leases still
held once the run is idle (`held`, `--settle-s` after the load: a reservation whose release
a fault lost waits for its lease to expire, unrenewed, after `--kv-wait-timeout-s`), those
still held once every lease could have expired (leaked), requests placed twice (`twice`: more
`placed` events than the gateway placed them, from a conductor placing a delivery that was
placed already), recovery seconds (fault to the first token of a request sent after it),
TTFT p99 against the fault-free run.

    python -m bench.chaos [--scenarios kill-decode,restart-nats] [--requests 48]
    python -m bench.chaos --engine torch --long-prompts --requests 24
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from bench.chaos_cluster import SCENARIOS, Cluster, ProcessCluster, UpCluster, inject
from bench.control_path import MODEL


@dataclass
class Outcome:
    """One client request: HTTP status, the text it got, when it was sent, its TTFT, and
    which gateway it went to."""

    prompt: str
    gateway: int = 0
    status: int = 0
    text: str = ""
    sent_at: float = 0.0
    ttft_s: float | None = None
    error: str = ""  # the error a failed request got


@dataclass
class Row:
    scenario: str
    requests: int = 0
    completed: int = 0
    truncated: int = 0
    wrong: int = 0
    errors: Counter[int] = field(default_factory=Counter)
    error_messages: Counter[str] = field(default_factory=Counter)
    own_affected: int = 0  # kill-gateway: the killed gateway's own requests not completed
    missing_tokens: int = 0
    duplicated_tokens: int = 0
    held: tuple[int, int] = (0, 0)  # (KV blocks, leases) still held at the settle time
    leaked_blocks: int = 0
    leaked_leases: int = 0
    placed_twice: int = 0
    recovery_s: float | None = None
    ttft_p99_ms: float = 0.0


async def stream_one(session: aiohttp.ClientSession, urls: list[str], outcome: Outcome,
                     max_tokens: int) -> None:
    url = urls[outcome.gateway]
    body = {"model": MODEL, "prompt": outcome.prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    outcome.sent_at = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.error = (await response.text())[:300]
                return
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    outcome.status = 500
                    outcome.error = chunk["error"].get("message", "")
                    return
                text = chunk["choices"][0]["text"]
                if text and outcome.ttft_s is None:
                    outcome.ttft_s = time.monotonic() - outcome.sent_at
                outcome.text += text
    except (aiohttp.ClientError, TimeoutError) as exc:
        outcome.status = outcome.status or 599
        outcome.error = repr(exc)


async def run_load(urls: list[str], prompts: list[str], clients: int, max_tokens: int
                   ) -> list[Outcome]:
    """Every prompt streamed once; request i goes to gateway i mod len(urls)."""
    outcomes = [Outcome(prompt, gateway=i % len(urls)) for i, prompt in enumerate(prompts)]
    queue: asyncio.Queue[Outcome] = asyncio.Queue()
    for outcome in outcomes:
        queue.put_nowait(outcome)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client() -> None:
            while not queue.empty():
                await stream_one(session, urls, queue.get_nowait(), max_tokens)

        await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


async def run_scenario(scenario: str, args: argparse.Namespace, prompts: list[str]
                       ) -> tuple[list[Outcome], Cluster, float]:
    cluster = ProcessCluster(args) if args.launch == "processes" else UpCluster(args)
    try:
        await cluster.start()
    except BaseException:
        await cluster.stop_processes()  # what came up before it gave up (a gateway lingered)
        raise
    fault_at = 0.0
    try:
        load = asyncio.ensure_future(run_load(cluster.urls, prompts, args.clients,
                                              args.max_tokens))
        await asyncio.sleep(args.fault_at_s)
        fault_at = time.monotonic()
        if scenario != "none":
            await inject(cluster, scenario)
        outcomes = await load
        await cluster.settle(args.settle_s)
        return outcomes, cluster, fault_at
    finally:
        await cluster.stop()


def tokens(text: str) -> list[int]:
    return list(text.encode())  # the fake engine's byte tokenizer: one token per byte


_WORDS = ("river", "stone", "cloud", "lantern", "harbor", "meadow", "copper", "violet",
          "winter", "engine", "signal", "garden")


def make_prompts(args: argparse.Namespace) -> list[str]:
    if not args.long_prompts:
        return [f"chaos request {i}: tell me something" for i in range(args.requests)]
    draw = random.Random(7)  # the same prompts in every scenario
    return [f"chaos request {i}: " + " ".join(draw.choices(_WORDS, k=draw.randint(40, 450)))
            for i in range(args.requests)]


def score(scenario: str, outcomes: list[Outcome], reference: dict[str, str],
          cluster: Cluster, fault_at: float) -> Row:
    row = Row(scenario, requests=len(outcomes))
    for outcome in outcomes:
        expected = tokens(reference.get(outcome.prompt, ""))
        got = tokens(outcome.text)
        if scenario == "kill-gateway" and outcome.gateway == 1 and (
                outcome.status != 200 or got != expected):
            row.own_affected += 1  # the killed gateway's own client: allowed to fail
            continue
        if outcome.status != 200:
            row.errors[outcome.status] += 1
            row.error_messages[f"{outcome.status}: {outcome.error}"] += 1
            continue
        if got == expected:
            row.completed += 1
        elif expected[:len(got)] == got:
            row.truncated += 1
            row.missing_tokens += len(expected) - len(got)
        else:
            row.wrong += 1
            row.duplicated_tokens += max(0, len(got) - len(expected))
            row.missing_tokens += max(0, len(expected) - len(got))
    row.held = cluster.held_at_settle
    row.leaked_blocks, row.leaked_leases = cluster.leaked()
    row.placed_twice = cluster.placed_twice()
    after = [o.sent_at + o.ttft_s for o in outcomes
             if o.ttft_s is not None and o.sent_at >= fault_at]
    row.recovery_s = min(after) - fault_at if after and scenario != "none" else None
    ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    row.ttft_p99_ms = 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts \
        else 0.0
    return row


def print_table(rows: list[Row]) -> None:
    base = rows[0].ttft_p99_ms or 1.0
    print(f"{'scenario':<15} {'req':>4} {'ok':>4} {'own':>4} {'trunc':>5} {'wrong':>5} "
          f"{'errors':<12} {'miss':>5} {'dup':>4} {'held':>6} {'blocks':>6} {'leases':>6} "
          f"{'twice':>5} {'recov s':>7} {'TTFT p99':>9} {'x ref':>6}")
    for r in rows:
        errors = ",".join(f"{k}:{v}" for k, v in sorted(r.errors.items())) or "-"
        recovery = f"{r.recovery_s:.2f}" if r.recovery_s is not None else "-"
        held = "{}/{}".format(*r.held)
        print(f"{r.scenario:<15} {r.requests:>4} {r.completed:>4} {r.own_affected:>4} "
              f"{r.truncated:>5} {r.wrong:>5} {errors:<12} {r.missing_tokens:>5} "
              f"{r.duplicated_tokens:>4} {held:>6} {r.leaked_blocks:>6} {r.leaked_leases:>6} "
              f"{r.placed_twice:>5} {recovery:>7} "
              f"{r.ttft_p99_ms:>7.1f}ms {r.ttft_p99_ms / base:>5.2f}x")
    for r in rows:
        for message, count in r.error_messages.most_common():
            print(f"  {r.scenario}: {count} x {message}")


async def run(args: argparse.Namespace) -> list[Row]:
    prompts = make_prompts(args)
    outcomes, cluster, fault_at = await run_scenario("none", args, prompts)
    reference = {o.prompt: o.text for o in outcomes if o.status == 200}
    rows = [score("none", outcomes, reference, cluster, fault_at)]
    for scenario in args.scenarios:
        if scenario == "none":
            continue
        outcomes, cluster, fault_at = await run_scenario(scenario, args, prompts)
        rows.append(score(scenario, outcomes, reference, cluster, fault_at))
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", type=lambda s: s.split(","),
                        default=list(SCENARIOS[1:]))
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--token-delay-s", type=float, default=0.02)
    parser.add_argument("--fault-at-s", type=float, default=1.0)
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--launch", choices=["up", "processes"], default="up",
                        help="halfmoon up (supervised), or every service started by hand")
    parser.add_argument("--engine", choices=["fake", "torch"], default="fake",
                        help="the workers' engine (torch: the built-in model; --launch up)")
    parser.add_argument("--long-prompts", action="store_true",
                        help="prompts of 40 to 450 words instead of a few")
    parser.add_argument("--up-flags", type=str.split, default=[],
                        help="more `halfmoon up` flags, in one string (--launch up)")
    args = parser.parse_args(argv)
    if args.engine == "torch" and args.launch != "up":
        parser.error("--engine torch runs with --launch up (its gateways need the model)")
    if args.up_flags and args.launch != "up":
        parser.error("--up-flags are `halfmoon up`'s: they run with --launch up")
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    rows = asyncio.run(run(parse_args(argv)))
    print_table(rows)
    clean = all(r.completed + r.own_affected == r.requests and not r.leaked_blocks
                and not r.leaked_leases for r in rows)
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
