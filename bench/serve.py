"""`halfmoon bench serve`: load-test any OpenAI-compatible server.

    halfmoon bench serve --url http://127.0.0.1:8000 --rate 4 --num-requests 200 \\
        --input-len 512 --output-len 64 --slo-ttft-ms 2000 --slo-itl-ms 100 --out results/

Workloads (`bench/workload.py`): open loop at `--rate` requests/s (`--burstiness` < 1 for
bursts), closed loop with `--concurrency` clients, or `--trace` replay of a Mooncake jsonl
trace (its arrival times; `--time-divisor` > 1 replays it faster, `--length-divisor` shortens
prompts). Each request streams; TTFT, inter-token latency, TPOT and end-to-end latency are
measured per request (`bench/client.py`) and summarized (`bench/results.py`). `--out` gets
`results.json` (settings, summary, every request) and two PNGs: TTFT/ITL CDFs and output
throughput over time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from bench.client import CompletionClient, RequestRecord
from bench.results import Slo, Summary, format_summary, summarize
from bench.trace import DEFAULT_TRACE, TraceScaling
from bench.workload import BenchRequest, Phase, SyntheticSpec, from_trace, phased, synthetic


async def run_requests(client: CompletionClient, requests: Sequence[BenchRequest], *,
                       concurrency: int | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None
                       ) -> tuple[list[RequestRecord], float]:
    """Send `requests` (open loop at their arrival times, or closed loop with `concurrency`
    clients); return their records, in request order, and the wall time."""
    started = time.perf_counter()
    records: list[RequestRecord | None] = [None] * len(requests)

    async def send(index: int) -> None:
        records[index] = record = await client.send(requests[index], started)
        if on_done is not None:
            on_done(record)

    if concurrency is None:
        async def at_arrival(index: int) -> None:
            arrival_s = requests[index].arrival_s or 0.0
            await asyncio.sleep(max(0.0, started + arrival_s - time.perf_counter()))
            await send(index)

        await asyncio.gather(*(at_arrival(i) for i in range(len(requests))))
    else:
        pending = iter(range(len(requests)))

        async def closed_loop_client() -> None:
            for index in pending:
                await send(index)

        await asyncio.gather(*(closed_loop_client() for _ in range(concurrency)))
    return [r for r in records if r is not None], time.perf_counter() - started


def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists."""
    request = urllib.request.Request(base_url.rstrip("/") + "/v1/models")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=10) as response:
        models = json.loads(response.read())["data"]
    if not models:
        raise SystemExit(f"{base_url} serves no model")
    return models[0]["id"]


async def benchmark(base_url: str, requests: Sequence[BenchRequest], slo: Slo, *,
                    model: str | None = None, api_key: str | None = None,
                    concurrency: int | None = None, progress: bool = False
                    ) -> tuple[Summary, list[RequestRecord]]:
    model = model or await asyncio.to_thread(served_model, base_url, api_key)
    client = CompletionClient(base_url, model, api_key=api_key)
    bar = _progress_bar(len(requests)) if progress else None
    try:
        records, wall_s = await run_requests(
            client, requests, concurrency=concurrency,
            on_done=(lambda _record: bar.update(1)) if bar is not None else None)
    finally:
        await client.close()
        if bar is not None:
            bar.close()
    return summarize(records, wall_s, slo), records


def _progress_bar(total: int):  # type: ignore[no-untyped-def]
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)


def write_results(out: Path, settings: dict[str, object], summary: Summary,
                  records: list[RequestRecord], *, is_plotting: bool = True) -> list[Path]:
    from bench import plots

    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    results.write_text(json.dumps({"settings": settings, "summary": summary.to_dict(),
                                   "requests": [asdict(r) for r in records]}, indent=1,
                                  default=str))
    written = [results]
    if is_plotting:
        written += [plots.latency_cdfs([("run", records)], out / "latency_cdf.png"),
                    plots.throughput_over_time([("run", records)], out / "throughput.png")]
    return written


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("workload")
    group.add_argument("--num-requests", type=int, default=200)
    group.add_argument("--input-len", type=int, default=512, help="mean prompt tokens")
    group.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="lengths uniform within mean x [1 - r, 1 + r]")
    group.add_argument("--rate", type=float, default=None,
                       help="open loop: requests/s (default: closed loop)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of inter-arrival gaps (1: Poisson, < 1: bursty)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--phase", dest="phases", action="append", type=Phase.parse,
                       default=[], metavar="INPUT:OUTPUT:NUM",
                       help="a stretch of NUM requests of these mean lengths; several run "
                            "one after another (replaces --input-len, --output-len, "
                            "--num-requests)")
    group.add_argument("--trace", type=Path, nargs="?", const=DEFAULT_TRACE, default=None,
                       help="replay a Mooncake jsonl trace (default file: the synthetic one)")
    group.add_argument("--trace-limit", type=int, default=None, help="its first N requests")
    group.add_argument("--length-divisor", type=int, default=1,
                       help="trace: prompt lengths / this (divides 512)")
    group.add_argument("--output-divisor", type=int, default=1, help="trace: outputs / this")
    group.add_argument("--time-divisor", type=float, default=1.0,
                       help="trace: time / this (2: twice the request rate)")
    group.add_argument("--max-total-len", type=int, default=None,
                       help="trace: leave out requests whose prompt + output is longer")


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    if args.trace is not None:
        scaling = TraceScaling(args.length_divisor, args.output_divisor, args.time_divisor)
        requests = from_trace(args.trace, scaling, limit=args.trace_limit,
                              max_total_len=args.max_total_len)
        if args.rate is not None or args.concurrency is not None:
            raise SystemExit("--trace brings its own arrivals: no --rate or --concurrency")
        return requests
    if args.rate is not None and args.concurrency is not None:
        raise SystemExit("--rate (open loop) and --concurrency (closed loop) exclude each other")
    if args.rate is None and args.concurrency is None:
        args.concurrency = 1
    spec = SyntheticSpec(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, rate=args.rate, burstiness=args.burstiness,
        seed=args.seed)
    return phased(args.phases, spec) if args.phases else synthetic(spec)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfmoon bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="default: the first one it serves")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, default=None,
                        help="closed loop: this many clients")
    add_workload_flags(parser)
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-itl-ms", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json and the plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        requests = build_workload(args)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"halfmoon bench serve: {exc}") from exc
    if not requests:
        raise SystemExit("halfmoon bench serve: the workload has no requests")
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    summary, records = asyncio.run(benchmark(
        args.url, requests, slo, model=args.model, api_key=args.api_key,
        concurrency=args.concurrency, progress=not args.no_progress))
    print(format_summary(summary))
    if args.out is not None:
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        for path in write_results(args.out, settings, summary, records,
                                  is_plotting=not args.no_plots):
            print(f"wrote {path}")
    return 0 if summary.num_ok else 1
