"""Engine benchmark: our TorchEngine beside transformers' own `generate`, same model, same run.

A random-weight Llama (default: hidden 1024, 16 layers, vocab 32000, about 250 M parameters)
in bfloat16 on the CPU. Prints prefill tokens/s at each prompt length, decode tokens/s at each
batch size (prompt 128, `--decode-tokens` new tokens), each with transformers' figure and the
ratio, and decode at batch 1 as a fraction of the memory-bandwidth limit (weight bytes per
step over measured copy bandwidth, the weights counted in the dtype the engine holds them
in). The "before" column is the same engine with the `--before` attention backend (default
`reference`: the per-sequence loop the engine ran before one batched call per layer) and
`--before-weights`, measured in the same run. `--rounds N` measures every workload N times,
the three taking turns going first, and prints medians: on a shared machine one sample each
leaves the ratios to the machine's drift (10-20 % between consecutive runs here).
Each of the three runs in a process of its own, as a worker process holds one engine
(`bench.engine_processes`): what serving sees. `--in-process` runs them all in this process
instead, transformers computing in a thread of its own: with two engine threads the process
then holds three OpenMP teams, more threads than a 2-core host has, where libgomp puts idle
workers to sleep at once (`engine.compute_threads`) and each pays a wake-up per operator,
which costs the engines (many small operators a step) more than transformers (bf16 decode
at batch 32 here: ours 369 tok/s in one process against 410 in its own, transformers 200
against 192).

    python -m bench.engine_throughput --prompts 512,2048 --batches 1,8,32
    python -m bench.engine_throughput --before torch --rounds 3
    python -m bench.engine_throughput --before torch --before-weights plain  # CPU weights
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from engine.attention import BACKENDS
from engine.linear import policy_for
from engine.protocol import PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams


def make_model(path: Path, args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(args.torch_dtype).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


def copy_bandwidth_gbs() -> float:
    """Memory traffic of a large copy, read plus write, in GB/s."""
    src = torch.empty(256 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    started = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 5 * 2 * src.numel() / (time.perf_counter() - started) / 1e9


def prompt(length: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % 31000 + 100 for i in range(length)]


async def ours_prefill(engine: TorchEngine, length: int, salt: int) -> float:
    params = SamplingParams(max_tokens=1, temperature=0.0)
    started = time.perf_counter()
    await engine.prefill(PrefillRequest(f"p{salt}", prompt(length, salt), params))
    elapsed = time.perf_counter() - started
    engine.release(f"p{salt}")
    return length / elapsed


async def ours_decode(engine: TorchEngine, batch: int, new_tokens: int, salt: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"d{salt}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        engine.generate(PrefillRequest(request_id, prompt(128, salt * 100 + i), params))
    seen: dict[str, int] = {}
    started = None
    while len([r for r in ids if seen.get(r, 0) >= new_tokens]) < batch:
        for out in await engine.next_step():
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
        if started is None and all(seen.get(r, 0) >= 1 for r in ids):
            started = time.perf_counter()  # every prompt is in: decode starts here
    assert started is not None
    return batch * (new_tokens - 1) / (time.perf_counter() - started)


def hf_prefill(model: Any, length: int, salt: int) -> float:
    ids = torch.tensor([prompt(length, salt)])
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
    return length / (time.perf_counter() - started)


class FirstTokenClock:
    """A `generate` streamer that notes when the first new token arrives (the first `put`
    carries the prompt), so decode time excludes prefill."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_at: float | None = None

    def put(self, value: Any) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        return None


def hf_decode(model: Any, batch: int, new_tokens: int, salt: int) -> float:
    ids = torch.tensor([prompt(128, salt * 100 + i) for i in range(batch)])
    clock = FirstTokenClock()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       streamer=clock)
    assert clock.first_token_at is not None
    return batch * (new_tokens - 1) / (time.perf_counter() - clock.first_token_at)


# One workload's run by one party (0 ours, 1 the before engine, 2 transformers): workload
# ("prefill" or "decode"), its arguments (length, or batch and new tokens; then a salt) -> tok/s.
Measure = Callable[[int, str, tuple[int, ...]], Awaitable[float]]
Rows = list[tuple[str, float, float, float]]  # workload, ours, before, transformers (tok/s)
OURS = {"prefill": ours_prefill, "decode": ours_decode}
THEIRS = {"prefill": hf_prefill, "decode": hf_decode}


async def measure_rows(args: argparse.Namespace, measure: Measure) -> Rows:
    """(workload, ours, before, transformers) tokens/s per workload: each the median of
    `args.rounds` rounds, in which the three take turns going first (the machine's speed
    drifts within a run; one sample each leaves a ratio to that drift)."""
    workloads = [(f"prefill {length} tok", "prefill", (length,)) for length in args.prompts]
    workloads += [(f"decode batch {batch}", "decode", (batch, args.decode_tokens))
                  for batch in args.batches]
    rows = []
    for i, (name, workload, sizes) in enumerate(workloads):
        samples: list[list[float]] = [[], [], []]
        for round_ in range(args.rounds):
            for k in range(3):
                which = (round_ + k) % 3
                samples[which].append(await measure(which, workload,
                                                    (*sizes, i + 100 * round_)))
        now, then, theirs = (statistics.median(s) for s in samples)
        rows.append((name, now, then, theirs))
    return rows


def engine_options(args: argparse.Namespace, before: bool) -> dict[str, Any]:
    """`EngineOptions` (less the model and dtype) of ours, or of the before engine."""
    return dict(
        attention_backend=args.before if before else args.attention_backend,
        cpu_weights=(args.before_weights or args.cpu_weights) if before else args.cpu_weights,
        num_blocks=args.num_blocks, block_size=16, max_batch_size=64,
        max_batch_tokens=4096, max_wait_s=0.0, is_prefix_caching=False)


async def in_one_process(args: argparse.Namespace, model_dir: Path
                         ) -> tuple[int, Rows, float]:
    """Parameters, rows and copy bandwidth (GB/s), the three in this process: transformers
    in a thread of its own, on all cores, as each engine computes in its engine thread (the
    loop's thread computes serially once an engine starts)."""
    baseline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transformers")
    in_baseline = functools.partial(asyncio.get_running_loop().run_in_executor, baseline)
    try:
        hf = await in_baseline(make_model, model_dir, args)
        engines = []
        for before in (False, True):
            engines.append(TorchEngine(EngineOptions(
                model_dir=model_dir, dtype=args.torch_dtype, **engine_options(args, before))))
            await engines[-1].start()
        try:
            for engine in engines:
                await ours_prefill(engine, 64, 999)  # warm-up
            await in_baseline(hf_prefill, hf, 64, 999)

            async def measure(which: int, workload: str, call: tuple[int, ...]) -> float:
                if which == 2:
                    return await in_baseline(THEIRS[workload], hf, *call)
                return await OURS[workload](engines[which], *call)

            rows = await measure_rows(args, measure)
        finally:
            for engine in engines:
                await engine.close()
        params = sum(p.numel() for p in hf.parameters())
        return params, rows, await in_baseline(copy_bandwidth_gbs)
    finally:
        baseline.shutdown()


async def in_own_processes(args: argparse.Namespace, model_dir: Path
                           ) -> tuple[int, Rows, float]:
    """Parameters, rows and copy bandwidth (GB/s), each of the three in a process of its
    own (the default); this process only makes the model and measures the bandwidth."""
    from bench.engine_processes import TRANSFORMERS, PartyProcess

    params = sum(p.numel() for p in make_model(model_dir, args).parameters())
    parties: list[PartyProcess] = []
    try:
        for before in (False, True):
            parties.append(await asyncio.to_thread(
                PartyProcess, "before" if before else "halfmoon", model_dir,
                args.torch_dtype, engine_options(args, before)))
        parties.append(await asyncio.to_thread(PartyProcess, TRANSFORMERS, model_dir,
                                               args.torch_dtype))

        async def measure(which: int, workload: str, call: tuple[int, ...]) -> float:
            return await asyncio.to_thread(parties[which].measure, workload, *call)

        rows = await measure_rows(args, measure)
    finally:
        for party in parties:
            party.close()
    return params, rows, copy_bandwidth_gbs()  # on all cores: this thread computes alone


async def run(args: argparse.Namespace) -> None:
    threads = torch.get_num_threads()  # (before an engine makes this thread serial)
    with tempfile.TemporaryDirectory() as tmp:
        setup = in_one_process if args.in_process else in_own_processes
        params, rows, bandwidth = await setup(args, Path(tmp))
    print(f"model: {params / 1e6:.0f} M parameters, {args.dtype}, "
          f"{threads} threads; attention {args.attention_backend}, "
          f"CPU weights {args.cpu_weights}; before: attention {args.before}, CPU "
          f"weights {args.before_weights or args.cpu_weights}; "
          + ("all in this process" if args.in_process else "each in a process of its own"))
    if args.rounds > 1:
        print(f"each figure the median of {args.rounds} rounds (the three measured in a "
              "rotating order)")
    print(f"{'workload':<18} {'halfmoon tok/s':>15} {'before tok/s':>13} "
          f"{'transformers tok/s':>19} {'vs transformers':>16} {'vs before':>10}")
    for name, now, then, theirs in rows:
        print(f"{name:<18} {now:>15.1f} {then:>13.1f} {theirs:>19.1f} "
              f"{now / theirs:>15.2f}x {now / then:>9.2f}x")
    policy = policy_for(torch.device("cpu"), args.torch_dtype, args.cpu_weights)
    held = policy.packed_dtype if policy is not None and policy.packed_dtype else args.torch_dtype
    weight_bytes = params * torch.tensor([], dtype=held).element_size()
    limit = bandwidth * 1e9 / weight_bytes
    batch1 = next((now for name, now, _, _ in rows if name == "decode batch 1"), None)
    print(f"memory bandwidth (copy, read + write) {bandwidth:.1f} GB/s; weights "
          f"{weight_bytes / 1e9:.2f} GB per step -> batch-1 limit {limit:.1f} tok/s")
    if batch1 is not None:
        print(f"decode batch 1 reaches {batch1 / limit:.0%} of the memory-bandwidth limit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--prompts", type=ints, default=[512, 2048])
    parser.add_argument("--batches", type=ints, default=[1, 8, 32])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each workload this many times, reporting medians")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--attention-backend", choices=BACKENDS, default="auto")
    parser.add_argument("--before", choices=BACKENDS[1:], default="reference")
    parser.add_argument("--cpu-weights", choices=["packed", "plain"], default="packed")
    parser.add_argument("--before-weights", choices=["packed", "plain"], default=None,
                        help="the before engine's CPU weights (default: --cpu-weights)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--in-process", action="store_true",
                       help="all three in this process, transformers in a thread (default: "
                            "each in a process of its own, as a worker holds one engine)")
    where.add_argument("--isolated", action="store_true",
                       help="each in a process of its own: the default, named for older "
                            "commands")
    args = parser.parse_args(argv)
    args.torch_dtype = getattr(torch, args.dtype)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
