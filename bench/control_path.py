"""Control-path benchmark: the whole stack with the fake engine at zero delay.

Starts `halfmoon up --engine fake` (every service its own process, embedded NATS) unless
`--url` names a running server, then drives it with N concurrent streaming clients for each N
in `--concurrency`, each request asking for `--max-tokens` tokens. Prints requests/s, streamed
tokens/s and TTFT p50/p99 per level, and each level's throughput as a ratio of the first
level measured in the same run (machines here are shared and noisy; ratios travel, absolute
numbers do not).

    python -m bench.control_path --concurrency 1,16,64 --duration-s 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import aiohttp

from bench.results import percentile
from shared.child_process import die_with_parent
from shared.nats_server import free_port

MODEL = "halfmoon-tiny"


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    num_requests: int
    num_errors: int
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float


async def one_request(session: aiohttp.ClientSession, url: str, max_tokens: int, i: int
                      ) -> tuple[float, float, int]:
    """(ttft_s, e2e_s, tokens) of one streamed completion."""
    body = {"model": MODEL, "prompt": f"benchmark prompt {i}", "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    ttft = None
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    return ttft or float("nan"), time.perf_counter() - started, tokens


async def run_level(url: str, concurrency: int, duration_s: float, max_tokens: int
                    ) -> LevelResult:
    ttfts: list[float] = []
    e2es: list[float] = []
    counts = {"tokens": 0, "errors": 0, "next": 0}
    deadline = time.perf_counter() + duration_s
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            counts["next"] += 1
            try:
                ttft, e2e, tokens = await one_request(session, url, max_tokens, counts["next"])
            except (aiohttp.ClientError, ValueError):
                counts["errors"] += 1
                continue
            ttfts.append(ttft)
            e2es.append(e2e)
            counts["tokens"] += tokens

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return LevelResult(
        concurrency=concurrency, num_requests=len(e2es), num_errors=counts["errors"],
        requests_per_s=len(e2es) / elapsed, tokens_per_s=counts["tokens"] / elapsed,
        ttft_p50_ms=1000 * percentile(ttfts, 0.5), ttft_p99_ms=1000 * percentile(ttfts, 0.99),
        e2e_p50_ms=1000 * percentile(e2es, 0.5),
    )


def launch(*up_args: str, logs: list[str] | None = None, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen[str], str]:
    """`halfmoon up` with these flags (and `env`: e.g. `HALFMOON_<FLAG>` settings for every
    service) on a free port, once it is up; its services' log lines are collected into
    `logs` when given. It ends with this process, however that ends (a benchmark killed
    mid-run leaves no stack behind)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), *up_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE if logs is not None else None,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=die_with_parent,
    )
    assert process.stdout is not None
    if logs is not None:
        threading.Thread(target=lambda: logs.extend(process.stderr),  # type: ignore[arg-type]
                         daemon=True).start()
    for line in process.stdout:
        if "halfmoon is up" in line:
            return process, f"http://127.0.0.1:{port}"
    raise SystemExit(f"halfmoon up {' '.join(up_args)} exited with {process.wait()}")


@contextlib.contextmanager
def launched(*up_args: str, logs: list[str] | None = None, env: dict[str, str] | None = None
             ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`launch`, stopped (SIGTERM, as Ctrl-C would) when the block ends, however it ends."""
    process, url = launch(*up_args, logs=logs, env=env)
    try:
        yield process, url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def print_table(results: list[LevelResult]) -> None:
    base = results[0]
    print(f"{'clients':>7} {'requests':>8} {'err':>4} {'req/s':>8} {'tok/s':>9} "
          f"{'x req/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'E2E p50':>9}")
    for r in results:
        print(f"{r.concurrency:>7} {r.num_requests:>8} {r.num_errors:>4} "
              f"{r.requests_per_s:>8.1f} {r.tokens_per_s:>9.0f} "
              f"{r.requests_per_s / base.requests_per_s:>7.2f}x "
              f"{r.ttft_p50_ms:>7.2f}ms {r.ttft_p99_ms:>7.2f}ms {r.e2e_p50_ms:>7.1f}ms")


async def main_async(args: argparse.Namespace, url: str) -> list[LevelResult]:
    await run_level(url, 1, 1.0, args.max_tokens)  # warm-up: connections, JIT-free paths
    return [await run_level(url, n, args.duration_s, args.max_tokens)
            for n in args.concurrency]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running OpenAI-compatible server")
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 16, 64])
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    if args.url:
        results = asyncio.run(main_async(args, args.url))
    else:
        with launched("--engine", "fake", "--log-level", "warning") as (_, url):
            results = asyncio.run(main_async(args, url))
    print_table(results)
    if args.json_path:
        with open(args.json_path, "w") as out:
            json.dump([asdict(r) for r in results], out, indent=2)


if __name__ == "__main__":
    main()
