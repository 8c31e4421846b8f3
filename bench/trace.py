"""Mooncake request traces (`../shared/data/*.jsonl`), scaled to a small machine.

Each line: `timestamp` (ms from the start), `input_length`, `output_length` (tokens), and
`hash_ids`, one per 512-token prompt block, equal ids at equal positions meaning an equal
prefix. Scaling keeps the arrival order and the block-sharing structure: lengths are divided
by `length_divisor` (a 512-token trace block becomes 512 / divisor tokens), output lengths by
`output_divisor`, time by `time_divisor`. Prompts are made from the hash ids: block `h` is the
same `512 / divisor` token ids (from a RNG seeded with `h`) wherever it appears, so a prefix
the trace shares is a prefix the system really can reuse.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / \
    "mooncake_synthetic_trace.jsonl"
# Token ids every tokenizer of ours accepts (the byte tokenizer has 258).
_TOKEN_RANGE = range(1, 256)


@dataclass(frozen=True)
class TraceScaling:
    length_divisor: int = 32
    output_divisor: int = 4
    time_divisor: float = 8.0

    @property
    def block_tokens(self) -> int:
        """Tokens of one trace block after scaling."""
        if TRACE_BLOCK_TOKENS % self.length_divisor:
            raise ValueError(f"length_divisor must divide {TRACE_BLOCK_TOKENS}")
        return TRACE_BLOCK_TOKENS // self.length_divisor


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # after scaling, from the first request
    prompt_token_ids: list[int]
    max_tokens: int
    hash_ids: tuple[int, ...]


@lru_cache(maxsize=65536)
def _block(hash_id: int, num_tokens: int) -> tuple[int, ...]:
    rng = random.Random(hash_id)
    return tuple(rng.choice(_TOKEN_RANGE) for _ in range(num_tokens))


def trace_prompt(hash_ids: list[int], input_length: int, scaling: TraceScaling) -> list[int]:
    """The scaled prompt: the blocks of `hash_ids`, cut to the scaled input length."""
    length = max(1, math.ceil(input_length / scaling.length_divisor))
    tokens: list[int] = []
    for hash_id in hash_ids:
        tokens += _block(hash_id, scaling.block_tokens)
        if len(tokens) >= length:
            break
    return tokens[:length]


def load_trace(path: Path = DEFAULT_TRACE, scaling: TraceScaling = TraceScaling(),
               limit: int | None = None) -> list[TraceRequest]:
    return list(_read(path, scaling, limit))


def _read(path: Path, scaling: TraceScaling, limit: int | None) -> Iterator[TraceRequest]:
    with path.open() as lines:
        for i, line in enumerate(lines):
            if limit is not None and i >= limit:
                return
            record = json.loads(line)
            yield TraceRequest(
                arrival_s=record["timestamp"] / 1000 / scaling.time_divisor,
                prompt_token_ids=trace_prompt(record["hash_ids"], record["input_length"],
                                              scaling),
                max_tokens=max(1, math.ceil(record["output_length"] / scaling.output_divisor)),
                hash_ids=tuple(record["hash_ids"]),
            )
