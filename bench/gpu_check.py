"""The engine and KV path on an accelerator, in one command that writes a JSON report.

Prepared for a machine with a CUDA device (the project's CI has none); `--device cpu` runs
the same checks here, which is how the script itself is tested. Each section runs on its
own and records `ok` or its error, so one failure does not hide the rest:

* `logits`: our model against transformers on the same random Llama (fp32): relative
  logit error on a mixed batch, and 32 greedy tokens for 4 prompts.
* `decode`: decode tokens/s at batch 1 and 32 (bf16 on CUDA, fp32 on CPU) against
  transformers' `generate`, same weights; and with decode steps as CUDA graphs
  (`--cuda-graphs`; on a CPU their static buffers run without a graph), whose greedy tokens
  are compared with the plain engine's.
* `serving`: `halfmoon up` with 1 prefill + 1 decode worker moving KV over TCP (a device
  pool moves through the transfer engine's pinned host mirror), over CUDA IPC (device to
  device) and over shm (through the mirrors in shared memory), each against a colocated
  worker: the greedy outputs of 8 prompts must be equal; the transports the decode worker's
  commits name are recorded.
* `kv_transfer`: GB/s of one 256 MiB write into another process's device memory, over TCP
  (through both mirrors), over CUDA IPC and over shm into the peer's shared mirror; the
  bytes read back must be equal.
* `gpu_tests`: the test suite's `gpu`-marked tests (CUDA IPC between two processes, decode
  graphs against the plain engine, staged device tensors), run by pytest; its summary line.

    python -m bench.gpu_check [--device cuda] [--out gpu_check.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import torch

from bench.engine_throughput import FirstTokenClock
from engine.protocol import PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
PROMPTS = [[(37 * i + 11 * j) % 900 + 20 for j in range(n)]
           for i, n in enumerate([7, 19, 33, 64, 5, 48, 12, 27])]


def make_llama(path: Path, *, hidden: int, layers: int, scale: float = 1.0,
               vocab_size: int = 1000) -> Any:
    """A random Llama saved to `path` (weights scaled by `scale`: peaked logits)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128), max_position_embeddings=2048,
        tie_word_embeddings=False))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(scale)
    model.eval().save_pretrained(path, safe_serialization=True)
    return model


async def generate(engine: TorchEngine, prompts: list[list[int]], sampling: SamplingParams
                   ) -> tuple[list[list[int]], float]:
    """Every prompt's tokens, and decode tokens/s once every prompt has its first token."""
    ids = [f"g{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.generate(PrefillRequest(request_id, prompt, sampling))
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    started = None
    while any(len(t) < sampling.max_tokens for t in tokens.values()):
        for out in await engine.next_step():
            if out.error is not None:
                raise RuntimeError(out.error.message)
            tokens[out.request_id].append(out.token_id)
        if started is None and all(tokens.values()):
            started = time.perf_counter()
    elapsed = time.perf_counter() - (started or time.perf_counter())
    rate = len(ids) * (sampling.max_tokens - 1) / elapsed if elapsed > 0 else 0.0
    return [tokens[r] for r in ids], rate


def hf_greedy(model: Any, prompt: list[int], num_tokens: int, device: torch.device
              ) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def check_logits(tmp: Path, device: torch.device) -> dict[str, Any]:
    from engine.attention import AttentionMetadata, SequenceSlice
    from engine.kv_cache import KvCache
    from engine.model import CausalLM
    from engine.model_config import ModelConfig
    from engine.weights import load_weights

    hf = make_llama(tmp / "small", hidden=256, layers=4, scale=4.0).to(device)
    config = ModelConfig.from_dir(tmp / "small")
    model = CausalLM(config).to(device)
    load_weights(model, tmp / "small", torch.float32)
    model.init_runtime(512, device)
    kv = KvCache(num_layers=config.num_layers, num_blocks=64, block_size=16,
                 num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                 dtype=torch.float32, device=device)
    prompts = PROMPTS[:4]
    slices, slots, offset, first = [], [], 0, 0
    for prompt in prompts:
        blocks = list(range(first, first + -(-len(prompt) // 16)))
        first += len(blocks)
        positions = torch.arange(len(prompt))
        slots.append(torch.tensor(blocks)[positions // 16] * 16 + positions % 16)
        slices.append(SequenceSlice(offset, len(prompt), len(prompt), blocks))
        offset += len(prompt)
    with torch.inference_mode():
        hidden = model(torch.tensor([t for p in prompts for t in p], device=device),
                       torch.cat([torch.arange(len(p)) for p in prompts]).to(device),
                       AttentionMetadata(torch.cat(slots).to(device), slices), kv)
        ours = model.logits(hidden)
        reference = torch.cat([hf(torch.tensor([p], device=device)).logits[0] for p in prompts])
    relative = float((ours - reference).norm() / reference.norm())
    engine = TorchEngine(EngineOptions(model_dir=tmp / "small", device=str(device),
                                       num_blocks=256))
    await engine.start()
    try:
        tokens, _ = await generate(engine, prompts, GREEDY)
    finally:
        await engine.close()
    expected = [hf_greedy(hf, p, 32, device) for p in prompts]
    return {"relative_logit_error": relative, "logits_ok": relative < 1e-4,
            "greedy_32_equal": tokens == expected}


async def check_decode(tmp: Path, device: torch.device, hidden: int, layers: int
                       ) -> dict[str, Any]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = make_llama(tmp / "big", hidden=hidden, layers=layers).to(device=device, dtype=dtype)
    engine = TorchEngine(EngineOptions(model_dir=tmp / "big", dtype=dtype, device=str(device),
                                       num_blocks=4096, max_batch_size=64, max_wait_s=0.0,
                                       is_prefix_caching=False))
    # The same engine with decode steps as CUDA graphs (on a CPU: their buffers, no graph).
    graphed = TorchEngine(EngineOptions(model_dir=tmp / "big", dtype=dtype, device=str(device),
                                        num_blocks=4096, max_batch_size=64, max_wait_s=0.0,
                                        is_prefix_caching=False, attention_backend="torch",
                                        decode_graphs="cuda" if device.type == "cuda"
                                        else "eager"))
    await engine.start()
    await graphed.start()
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows = {}
    try:
        for warmed in (engine, graphed):
            await generate(warmed, [PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        for batch in (1, 32):
            prompts = [[(7 * i + j) % 900 + 20 for j in range(128)] for i in range(batch)]
            tokens, ours = await generate(engine, prompts, sampling)
            graph_tokens, with_graphs = await generate(graphed, prompts, sampling)
            ids = torch.tensor(prompts, device=device)
            clock = FirstTokenClock()
            with torch.inference_mode():
                hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                            min_new_tokens=32, do_sample=False, pad_token_id=0,
                            streamer=clock)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            assert clock.first_token_at is not None
            theirs = batch * 31 / (time.perf_counter() - clock.first_token_at)
            rows[f"batch_{batch}"] = {"halfmoon_tok_s": ours, "transformers_tok_s": theirs,
                                      "ratio": ours / theirs,
                                      "halfmoon_graphs_tok_s": with_graphs,
                                      "graphs_ratio": with_graphs / theirs,
                                      "graphs_tokens_equal": graph_tokens == tokens}
    finally:
        await engine.close()
        await graphed.close()
    return {"dtype": str(dtype), "hidden": hidden, "layers": layers, **rows}


async def check_serving(tmp: Path, device: torch.device) -> dict[str, Any]:
    from bench.control_path import launch
    from engine.builtin_model import write_builtin_model
    from engine.model_config import ModelConfig

    # The built-in model's tokenizer (the gateway needs one) under a bigger random Llama.
    builtin = write_builtin_model(tmp / "builtin")
    model_dir = tmp / "serve"
    make_llama(model_dir, hidden=256, layers=4, scale=4.0,
               vocab_size=ModelConfig.from_dir(builtin).vocab_size)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((builtin / name).read_bytes())
    common = ["--model", str(model_dir), "--device", str(device), "--log-level", "debug"]
    outputs, transports = {}, {}
    for name, args in SERVING_SETUPS.items():
        logs: list[str] = []
        process, url = launch(*common, *args, logs=logs)
        try:
            outputs[name] = await complete_prompts(url, model_dir.name, name)
        finally:
            os.kill(process.pid, signal.SIGINT)
            process.wait(timeout=60)
        if name != "colocated":
            transports[name] = sorted({json.loads(line)["transport"] for line in logs
                                       if "decode.kv_committed" in line
                                       and line.startswith("{")})
    return {f"{name}_equals_colocated": outputs[name] == outputs["colocated"]
            for name in SERVING_SETUPS if name != "colocated"} | {
        "kv_transports_seen": transports}


# On a CUDA device the second moves KV device to device (CUDA IPC), the first through the
# pinned host mirrors over TCP, the third through the mirrors in shared memory (shm); on a
# CPU the pools are shared memory themselves: tcp, tcp and shm.
SERVING_SETUPS = {
    "colocated": ["--mode", "colocated", "--workers", "1"],
    "disaggregated_tcp": ["--prefill", "1", "--decode", "1", "--transfer-transports", "tcp",
                          "--log-format", "json"],
    "disaggregated_cuda_ipc": ["--prefill", "1", "--decode", "1", "--transfer-transports",
                               "cuda,tcp", "--log-format", "json"],
    "disaggregated_shm_mirror": ["--prefill", "1", "--decode", "1", "--transfer-transports",
                                 "shm,tcp", "--log-format", "json"],
}


async def complete_prompts(url: str, model: str, setup: str) -> list[str]:
    async with aiohttp.ClientSession() as session:
        texts = []
        for prompt in PROMPTS:
            async with session.post(f"{url}/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True}) as response:
                body = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"{setup}: {response.status} {body}")
                texts.append(body["choices"][0]["text"])
        return texts


KV_BYTES = 256 * 2**20


async def check_kv_transfer(device: torch.device) -> dict[str, Any]:
    """256 MiB from a tensor on `device` into one on the same device in another process
    (CUDA IPC needs two): over TCP through both mirrors, and over the cuda transport (on a
    CPU that one falls back to TCP and says so)."""
    from transfer_engine.batch import TransferPiece
    from transfer_engine.config import TransferConfig
    from transfer_engine.engine import TransferEngine

    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.gpu_check", "--serve-kv", "--device", str(device),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None and child.stdin is not None
    rows: dict[str, Any] = {"bytes": KV_BYTES}
    try:
        port = int(await child.stdout.readline())
        source = torch.randint(0, 255, (KV_BYTES,), dtype=torch.uint8, device=device)
        for name, transports in (("tcp", ("tcp",)), ("cuda_ipc", ("cuda", "tcp")),
                                 ("shm_mirror", ("shm", "tcp"))):
            engine = TransferEngine(TransferConfig(engine_id=f"gpu-check-{name}",
                                                   secret=b"gpu-check", transports=transports))
            await engine.start()
            try:
                await engine.register("kv", source)
                peer = await engine.connect("127.0.0.1", port)
                pieces = [TransferPiece("kv", 0, "kv", 0, KV_BYTES)]
                await engine.write(peer, pieces)  # warm-up: connections, mirrors, mappings
                started = time.perf_counter()
                result = await engine.write(peer, pieces)
                seconds = time.perf_counter() - started
                back = torch.zeros_like(source)
                await engine.register("back", back)
                await engine.read(peer, [TransferPiece("back", 0, "kv", 0, KV_BYTES)])
                rows[name] = {"transport": result.transport, "gb_per_s": KV_BYTES / seconds / 1e9,
                              "equal": bool(torch.equal(source, back))}
            finally:
                await engine.close()
    finally:
        child.stdin.close()
        await asyncio.wait_for(child.wait(), 60)
    return rows


async def serve_kv(device: torch.device) -> None:
    """The receiving process of `check_kv_transfer`: a `kv` tensor on `device`, served until
    stdin closes; its port on stdout."""
    from shared.logs import configure_logging
    from transfer_engine.config import TransferConfig
    from transfer_engine.engine import TransferEngine

    configure_logging("warning")  # stdout carries the port alone
    engine = TransferEngine(TransferConfig(engine_id="gpu-check-target", secret=b"gpu-check",
                                           transports=("cuda", "tcp")))
    await engine.start()
    await engine.register("kv", torch.zeros(KV_BYTES, dtype=torch.uint8, device=device))
    print(engine.endpoint().tcp_port, flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await engine.close()


REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_TEST_FILES = ["tests/transfer/test_cuda_ipc.py", "tests/engine/test_decode_graphs.py",
                  "tests/transfer/test_conformance.py"]


async def check_gpu_tests() -> dict[str, Any]:
    """`pytest -m gpu` over the files that hold such tests (they skip without CUDA)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
        *GPU_TEST_FILES, cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    output, _ = await process.communicate()
    lines = output.decode(errors="replace").strip().splitlines()
    if process.returncode not in (0, 5):  # 5: every test deselected or none collected
        raise RuntimeError("\n".join(lines[-30:]))
    return {"summary": lines[-1] if lines else ""}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    report: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__, "host": platform.node(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sections: dict[str, Callable[[], Any]] = {
            "logits": lambda: check_logits(tmp, device),
            "decode": lambda: check_decode(tmp, device, args.hidden, args.layers),
            "serving": lambda: check_serving(tmp, device),
            "kv_transfer": lambda: check_kv_transfer(device),
            "gpu_tests": check_gpu_tests}
        for name in args.sections.split(","):
            started = time.perf_counter()
            try:
                report[name] = {"ok": True, **await sections[name]()}
            except Exception as exc:  # a section's failure is its finding
                report[name] = {"ok": False, "error": repr(exc),
                                "traceback": traceback.format_exc()[-2000:]}
            report[name]["seconds"] = round(time.perf_counter() - started, 1)
            print(json.dumps({name: report[name]}, default=str)[:400], flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default)
    parser.add_argument("--sections", default="logits,decode,serving,kv_transfer,gpu_tests")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--hidden", type=int, default=1024, help="the decode section's model")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--serve-kv", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_kv:
        asyncio.run(serve_kv(torch.device(args.device)))
        return 0
    report = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0 if all(v.get("ok", True) for v in report.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
