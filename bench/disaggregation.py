"""Disaggregated against colocated serving on the real engine, same request mix, same run.

For each model (the built-in one, and a ~95 M-parameter random-weight Llama), starts
`halfmoon up` three ways, every service its own process:

    colocated      --mode colocated --workers 2   (the baseline: no KV moves)
    disaggregated  --prefill 1 --decode 1         (KV streamed layer by layer)
    disagg-whole   --prefill 1 --decode 1 --kv-streaming whole   (KV sent after prefill)

and drives each with the same seeded Poisson stream of streamed completions with mixed prompt
lengths. Prints TTFT and inter-token latency percentiles and throughput per setup, with
ratios against colocated, and the KV tail (last layer computed to KV fully at decode, from
the prefill workers' `prefill.committed` logs) layer-wise against whole.

    python -m bench.disaggregation [--duration-s 40] [--models builtin,llama-95m]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.control_path import launched
from bench.results import percentile

SETUPS = {
    "colocated": ["--mode", "colocated", "--workers", "2"],
    "disaggregated": ["--prefill", "1", "--decode", "1", "--kv-streaming", "layerwise"],
    "disagg-whole": ["--prefill", "1", "--decode", "1", "--kv-streaming", "whole"],
}


@dataclass
class Run:
    model: str
    setup: str
    served_name: str  # the model id the gateway serves (the directory name, or the built-in)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_errors: int = 0
    elapsed_s: float = 0.0
    kv_tails: list[float] = field(default_factory=list)
    kv_transports: set[str] = field(default_factory=set)


def make_llama_95m(directory: Path) -> Path:
    """The built-in model's tokenizer under a bigger random-weight Llama (8 x 1024)."""
    return make_llama(directory, hidden_size=1024, intermediate_size=2816, num_layers=8,
                      num_heads=16, num_kv_heads=8)


def make_llama(directory: Path, *, hidden_size: int, intermediate_size: int, num_layers: int,
               num_heads: int, num_kv_heads: int) -> Path:
    """A random-weight Llama of this shape with the built-in model's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.builtin_model import write_builtin_model

    write_builtin_model(directory)
    base = json.loads((directory / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048, bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"], tie_word_embeddings=True)
    torch.manual_seed(0)
    (directory / "model.safetensors").unlink()
    LlamaForCausalLM(config).eval().save_pretrained(directory, safe_serialization=True)
    return directory


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int],
                      max_tokens: int, run: Run) -> None:
    body = {"model": run.served_name, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    stamps: list[float] = []
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data: {"):
                    stamps.append(time.perf_counter())
    except aiohttp.ClientError:
        run.num_errors += 1
        return
    if not stamps:
        run.num_errors += 1
        return
    run.ttfts.append(stamps[0] - started)
    run.itls += [b - a for a, b in itertools.pairwise(stamps)]
    run.num_tokens += len(stamps)


async def drive(url: str, run: Run, args: argparse.Namespace, rate: float) -> None:
    """A seeded Poisson stream of requests: the same arrivals and prompts for every setup."""
    rng = random.Random(args.seed)
    lengths = [int(n) for n in args.prompt_lens.split(",")]
    started = time.perf_counter()
    pending = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        at = 0.0
        while at < args.duration_s:
            at += rng.expovariate(rate)
            prompt = [rng.randrange(3, 900) for _ in range(rng.choice(lengths))]
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            pending.append(asyncio.ensure_future(
                one_request(session, url, prompt, args.max_tokens, run)))
        await asyncio.gather(*pending)
    run.elapsed_s = time.perf_counter() - started


def read_kv_logs(logs: list[str], run: Run) -> None:
    for line in logs:
        if '"prefill.committed"' not in line:
            continue
        entry = json.loads(line)
        run.kv_tails.append(entry["kv_tail_seconds"])
        run.kv_transports.add(entry["transport"])


def measure(model: str, model_dir: Path | None, setup: str, args: argparse.Namespace,
            rate: float) -> Run:
    logs: list[str] = []
    model_flags = ("--model", str(model_dir)) if model_dir is not None else ()
    run = Run(model, setup, model_dir.name if model_dir is not None else "halfmoon-tiny")
    with launched("--log-level", "debug", *model_flags, *SETUPS[setup], logs=logs) as (_, url):
        asyncio.run(drive(url, run, args, rate))
    read_kv_logs(logs, run)
    return run


def ms(value: float) -> str:
    return f"{1000 * value:8.1f}"


def report(runs: list[Run]) -> None:
    print(f"{'model':>10} {'setup':>14} {'done':>5} {'err':>4} {'tok/s':>7} {'vs col':>6} "
          f"{'TTFT p50':>8} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'KV tail p50':>11} {'via':>5}")
    for run in runs:
        base = next(r for r in runs if r.model == run.model and r.setup == "colocated")
        tps = run.num_tokens / run.elapsed_s
        base_tps = base.num_tokens / base.elapsed_s or float("nan")
        tail = ms(statistics.median(run.kv_tails)) if run.kv_tails else "       -"
        print(f"{run.model:>10} {run.setup:>14} {len(run.ttfts):5d} {run.num_errors:4d} "
              f"{tps:7.1f} {tps / base_tps:6.2f} "
              f"{ms(percentile(run.ttfts, 0.5))} {ms(percentile(run.ttfts, 0.99))} "
              f"{ms(percentile(run.itls, 0.5))} {ms(percentile(run.itls, 0.99))} "
              f"{tail:>11} {','.join(sorted(run.kv_transports)) or '-':>5}")
    for model in dict.fromkeys(r.model for r in runs):
        layerwise = next((r for r in runs if r.model == model and r.setup == "disaggregated"),
                         None)
        whole = next((r for r in runs if r.model == model and r.setup == "disagg-whole"), None)
        if layerwise and whole and layerwise.kv_tails and whole.kv_tails:
            a, b = statistics.median(layerwise.kv_tails), statistics.median(whole.kv_tails)
            print(f"{model}: KV tail layer-wise {1000 * a:.2f} ms vs whole {1000 * b:.2f} ms "
                  f"({b / a:.1f}x shorter)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="builtin,llama-95m")
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--rate-builtin", type=float, default=4.0, help="requests/s")
    parser.add_argument("--rate-llama", type=float, default=0.5, help="requests/s")
    parser.add_argument("--prompt-lens", default="32,128,512")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models.split(","):
            model_dir = None if model == "builtin" else make_llama_95m(Path(scratch) / model)
            rate = args.rate_builtin if model == "builtin" else args.rate_llama
            for setup in args.setups.split(","):
                runs.append(measure(model, model_dir, setup, args, rate))
                print(f"done: {model} {setup}", file=sys.stderr, flush=True)
    report(runs)


if __name__ == "__main__":
    main()
