"""What FP8/INT8 KV on the wire (`--kv-transfer-dtype`) costs in output quality and saves in
bytes, measured with the transfer engine's own quantizer on real KV.

For each model, `--prompts` prompts (16 to 64 tokens) are prefilled in one batch; their KV
blocks are then sent through `transfer_engine.compression` piece by piece (one piece: one
layer's K or V of one block, as a handoff moves them) and dequantized into a second pool, as
a decode worker receives them. From each pool the model decodes greedily (`--tokens` tokens,
the first sampled from prefill's exact logits, as in serving). Prints per scheme: bytes per
handoff and the ratio to uncompressed, the share of prompts whose tokens all equal the
uncompressed run's, the mean number of leading tokens that agree, and the largest absolute
logit error (teacher-forced on the uncompressed run's tokens, every step).

    python -m bench.kv_compression [--prompts 100 --tokens 32]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, SequenceSlice
from engine.kv_cache import KvCache
from engine.model import CausalLM
from engine.model_config import ModelConfig
from engine.weights import load_weights
from transfer_engine import compression

BLOCK_SIZE = 16
SCHEMES = ("none", "fp8", "int8")


@dataclass
class Batch:
    """Each sequence's blocks are its own consecutive run of the pool."""

    prompts: list[list[int]]
    blocks_per_seq: int

    def blocks(self, seq: int) -> list[int]:
        return list(range(seq * self.blocks_per_seq, (seq + 1) * self.blocks_per_seq))

    def step(self, lengths: list[int], num_new: list[int]) -> AttentionMetadata:
        slots, slices, offset = [], [], 0
        for seq, (length, new) in enumerate(zip(lengths, num_new, strict=True)):
            first = seq * self.blocks_per_seq * BLOCK_SIZE
            slots.append(torch.arange(first + length, first + length + new))
            slices.append(SequenceSlice(offset, new, length + new, self.blocks(seq)))
            offset += new
        return AttentionMetadata(torch.cat(slots), slices)


def forward(model: CausalLM, kv: KvCache, batch: Batch, tokens: list[list[int]],
            lengths: list[int]) -> torch.Tensor:
    """Run each sequence's new `tokens` after its `lengths` cached ones; the logits of each
    sequence's last new token (`[B, vocab]`)."""
    meta = batch.step(lengths, [len(t) for t in tokens])
    positions = torch.cat([torch.arange(n, n + len(t)) for n, t in zip(lengths, tokens,
                                                                      strict=True)])
    hidden = model(torch.tensor([x for t in tokens for x in t]), positions, meta, kv)
    last = torch.tensor([s.query_start + s.query_len - 1 for s in meta.sequences])
    return model.logits(hidden[last])


def send(source: KvCache, target: KvCache, batch: Batch, scheme: str, dtype: str) -> int:
    """Copy every prompt block's K and V pieces from `source` to `target` the way the wire
    does (quantized and dequantized for fp8/int8); the bytes that crossed."""
    spec = None if scheme == "none" else compression.make(scheme, dtype)
    wire = 0
    for seq, prompt in enumerate(batch.prompts):
        for block in batch.blocks(seq)[:-(-len(prompt) // BLOCK_SIZE)]:
            for layer in range(source.data.shape[0]):
                for kind in range(2):  # one piece: one layer's K or V of one block
                    raw = source.data[layer, kind, block].contiguous()
                    view = memoryview(raw.view(torch.uint8).numpy())
                    landing = target.data[layer, kind, block]
                    if spec is None:
                        landing.copy_(raw)
                        wire += view.nbytes
                        continue
                    payload = compression.compress(view, spec)
                    scratch = torch.empty_like(raw)
                    compression.decompress_into(memoryview(payload), spec,
                                                memoryview(scratch.view(torch.uint8).numpy()))
                    landing.copy_(scratch)
                    wire += len(payload)
    return wire


@torch.inference_mode()
def measure(model_dir: Path, dtype: torch.dtype, num_prompts: int, num_tokens: int
            ) -> list[tuple[str, float, float, float, float, float]]:
    config = ModelConfig.from_dir(model_dir)
    model = CausalLM(config).to(dtype)
    load_weights(model, model_dir, dtype)
    model.init_runtime(256, torch.device("cpu"))
    model.eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, config.vocab_size) for _ in range(rng.randrange(16, 65))]
               for _ in range(num_prompts)]
    batch = Batch(prompts, -(-(64 + num_tokens) // BLOCK_SIZE))

    def pool() -> KvCache:
        return KvCache(num_layers=config.num_layers, num_blocks=num_prompts * batch.blocks_per_seq,
                       block_size=BLOCK_SIZE, num_kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, dtype=dtype, device=torch.device("cpu"))

    exact = pool()
    lengths = [0] * num_prompts
    first = forward(model, exact, batch, prompts, lengths).argmax(-1).tolist()
    prompt_lengths = [len(p) for p in prompts]
    dtype_name = str(dtype).removeprefix("torch.")
    runs: dict[str, tuple[list[list[int]], int]] = {}
    for scheme in SCHEMES:
        received = pool()
        wire = send(exact, received, batch, scheme, dtype_name)
        tokens = [[t] for t in first]
        for step in range(num_tokens - 1):  # free-running greedy
            step_lengths = [n + step for n in prompt_lengths]
            logits = forward(model, received, batch, [[t[-1]] for t in tokens], step_lengths)
            for seq, token in enumerate(logits.argmax(-1).tolist()):
                tokens[seq].append(token)
        runs[scheme] = (tokens, wire)
    reference_tokens, raw_bytes = runs["none"]
    rows = []
    for scheme in SCHEMES[1:]:
        tokens, wire = runs[scheme]
        received = pool()
        send(exact, received, batch, scheme, dtype_name)
        teacher = pool()
        send(exact, teacher, batch, "none", dtype_name)
        error = 0.0
        for step in range(num_tokens - 1):  # teacher-forced on the uncompressed tokens
            inputs = [[t[step]] for t in reference_tokens]
            step_lengths = [n + step for n in prompt_lengths]
            ours = forward(model, received, batch, inputs, step_lengths)
            theirs = forward(model, teacher, batch, inputs, step_lengths)
            error = max(error, float((ours - theirs).abs().max()))
        agree = [_leading_agreement(a, b) for a, b in zip(tokens, reference_tokens,
                                                          strict=True)]
        rows.append((scheme, wire / num_prompts, raw_bytes / wire,
                     sum(a == num_tokens for a in agree) / num_prompts,
                     sum(agree) / num_prompts, error))
    rows.insert(0, ("none", raw_bytes / num_prompts, 1.0, 1.0, float(num_tokens), 0.0))
    return rows


def _leading_agreement(ours: list[int], theirs: list[int]) -> int:
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            return index
    return len(ours)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--models", default="builtin,llama95m",
                        help="builtin (fp32) and/or llama95m (bf16)")
    args = parser.parse_args(argv)
    from bench.disaggregation import make_llama_95m
    from engine.builtin_model import write_builtin_model

    with tempfile.TemporaryDirectory() as tmp:
        makers = {"builtin": ("built-in (fp32)", write_builtin_model, torch.float32),
                  "llama95m": ("Llama 95M (bf16)", make_llama_95m, torch.bfloat16)}
        models = [(makers[key][0], makers[key][1](Path(tmp) / key), makers[key][2])
                  for key in args.models.split(",")]
        print(f"{args.prompts} prompts of 16-64 tokens, {args.tokens} greedy tokens each")
        print(f"{'model':<18} {'KV on the wire':<14} {'bytes/handoff':>14} {'x fewer':>8} "
              f"{f'all {args.tokens} agree':>13} {'leading agree':>14} "
              f"{'max |logit err|':>16}")
        for name, model_dir, dtype in models:
            for scheme, wire, ratio, whole, leading, error in measure(
                    model_dir, dtype, args.prompts, args.tokens):
                print(f"{name:<18} {scheme:<14} {wire:>14,.0f} {ratio:>7.2f}x "
                      f"{whole:>12.0%} {leading:>14.1f} {error:>16.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
