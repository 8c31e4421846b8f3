"""A request inside the engine: its tokens, its blocks, how far its KV is computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shared.messages import FinishReason, SamplingParams

LayerListener = Callable[[int, list[int]], None]  # (layer, the request's block ids)


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    arrived_at_s: float
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V is in the cache
    num_cached: int = 0  # of those, how many came from the prefix cache
    num_generated: int = 0
    is_prefill_only: bool = False  # a prefill worker's request: stop after the first token
    finish_reason: FinishReason | None = None
    on_layer: LayerListener | None = None
    block_hashes: list[bytes] = field(default_factory=list)  # of the prompt's full blocks
    num_registered: int = 0  # leading prompt blocks already in the prefix cache
    compute_started_at: float = 0.0  # perf_counter() when its first step began

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
