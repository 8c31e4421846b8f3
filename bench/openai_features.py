"""What the OpenAI features cost, against plain requests in the same run.

For each model (the built-in one, and the ~95 M-parameter random-weight Llama), starts
`halfmoon up --prefill 1 --decode 1` (every service its own process, prefix caching off so
that every prompt is computed) and measures, rounds interleaved:

  plain, json_schema, logprobs 5   batches of `--batch` concurrent chat requests (distinct
                                   prompts, `--max-tokens` each, ignore_eos for the plain and
                                   logprobs ones): output tokens/s, as a ratio of plain;
  n=8 vs 8 x n=1                   one request with n = 8 against 8 concurrent requests of the
                                   same prompt: prompt tokens prefilled and KV bytes moved
                                   (read from the prefill worker's /metrics) and E2E time, as
                                   ratios (aim: 1/8 of the prefill work and bytes).

    python -m bench.openai_features [--models builtin,llama-95m] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.control_path import launch
from bench.disaggregation import make_llama_95m

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 8},
    "bio": {"type": "string"}}, "required": ["name", "age", "tags", "bio"]}
KINDS = {
    "plain": {"ignore_eos": True},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": SCHEMA}}},
    "logprobs 5": {"ignore_eos": True, "logprobs": True, "top_logprobs": 5},
}


@dataclass
class Rates:
    tokens: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    fanout: dict[str, list[dict[str, float]]] = field(
        default_factory=lambda: {"n=8": [], "8 x n=1": []})


async def chat(session: aiohttp.ClientSession, url: str, model: str, content: str,
               max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": 1, **extra}
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        answer = await response.json()
        if response.status != 200:
            raise SystemExit(f"{response.status}: {answer}")
        return answer


async def batch_rate(session: aiohttp.ClientSession, url: str, model: str, kind: str,
                     args: argparse.Namespace, round_: int) -> float:
    started = time.perf_counter()
    answers = await asyncio.gather(*(
        chat(session, url, model, f"Request {round_}-{i} about {kind}: describe someone.",
             args.max_tokens, **KINDS[kind]) for i in range(args.batch)))
    elapsed = time.perf_counter() - started
    if kind == "json_schema":  # every output that ended by itself parses
        for answer in answers:
            choice = answer["choices"][0]
            if choice["finish_reason"] == "stop":
                json.loads(choice["message"]["content"])
    return sum(a["usage"]["completion_tokens"] for a in answers) / elapsed


async def scrape(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for url in urls:
        async with session.get(url) as response:
            for line in (await response.text()).splitlines():
                name, _, value = line.partition(" ")
                name = name.split("{")[0]
                if name in ("halfmoon_prefill_prompt_tokens_total",
                            "halfmoon_prefill_cached_tokens_total",
                            "halfmoon_kv_transfer_bytes_total"):
                    totals[name] = totals.get(name, 0.0) + float(value)
    return totals


async def fanout_cost(session: aiohttp.ClientSession, url: str, model: str, metrics: list[str],
                      args: argparse.Namespace, round_: int, *, forked: bool
                      ) -> dict[str, float]:
    before = await scrape(session, metrics)
    content = f"Round {round_}: one prompt, eight answers. " * 8
    started = time.perf_counter()
    if forked:
        await chat(session, url, model, content, args.max_tokens, n=8, ignore_eos=True)
    else:
        await asyncio.gather(*(chat(session, url, model, content, args.max_tokens,
                                    ignore_eos=True) for _ in range(8)))
    elapsed = time.perf_counter() - started
    await asyncio.sleep(0.2)  # the prefill worker counts the transfer as it commits
    after = await scrape(session, metrics)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return {"prefill_tokens": delta("halfmoon_prefill_prompt_tokens_total")
            - delta("halfmoon_prefill_cached_tokens_total"),
            "kv_bytes": delta("halfmoon_kv_transfer_bytes_total"), "e2e_s": elapsed}


async def measure(url: str, model: str, metrics: list[str], args: argparse.Namespace) -> Rates:
    rates = Rates()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        await batch_rate(session, url, model, "json_schema", args, -1)  # warm: compile, JIT
        await fanout_cost(session, url, model, metrics, args, -1, forked=True)
        for round_ in range(args.rounds):
            for kind in KINDS:
                rates.tokens[kind].append(await batch_rate(session, url, model, kind, args,
                                                           round_))
            for label, forked in (("n=8", True), ("8 x n=1", False)):
                rates.fanout[label].append(await fanout_cost(
                    session, url, model, metrics, args, round_, forked=forked))
    return rates


def report(model: str, rates: Rates) -> None:
    """The two tables; the ratios are what travels between machines."""
    plain = statistics.median(rates.tokens["plain"])
    print(f"\n{model}: output tokens/s at batch of the kind (median of rounds)")
    for kind, values in rates.tokens.items():
        rate = statistics.median(values)
        print(f"  {kind:<12} {rate:9.1f} tok/s   {rate / plain:5.2f}x plain")
    forked, separate = ({key: statistics.median(r[key] for r in rates.fanout[label])
                         for key in ("prefill_tokens", "kv_bytes", "e2e_s")}
                        for label in ("n=8", "8 x n=1"))
    print(f"{model}: n=8 against 8 separate requests of the same prompt")
    print(f"  {'':<16} {'n=8':>12} {'8 x n=1':>12} {'ratio':>7}")
    for key, label in (("prefill_tokens", "prefill tokens"), ("kv_bytes", "KV bytes moved"),
                       ("e2e_s", "E2E seconds")):
        a, b = forked[key], separate[key]
        ratio = a / b if b else float("nan")
        print(f"  {label:<16} {a:12.3g} {b:12.3g} {ratio:6.3f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,llama-95m")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            model_dir = None if model == "builtin" else make_llama_95m(Path(scratch) / model)
            logs: list[str] = []
            flags = ("--model", str(model_dir)) if model_dir is not None else ()
            process, url = launch("--log-level", "info", "--prefill", "1", "--decode", "1",
                                  "--no-enable-prefix-caching", *flags, logs=logs)
            try:
                time.sleep(1.0)  # the services' "metrics.serving" lines
                metrics = [json.loads(line)["url"] for line in list(logs)
                           if '"metrics.serving"' in line]  # summed: prefill's count
                served = model_dir.name if model_dir is not None else "halfmoon-tiny"
                rates = asyncio.run(measure(url, served, metrics, args))
            finally:
                process.terminate()
                process.wait(timeout=60)
            report(model, rates)
            print(f"done: {model}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
