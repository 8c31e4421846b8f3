"""A request inside the engine: its tokens, its blocks, how far its KV is computed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.messages import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.grammar import Matcher

LayerListener = Callable[[int, list[int]], None]  # (layer, the request's block ids)


@dataclass(eq=False)  # a sequence is itself: `in` and `remove` go by identity
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    sampling: SamplingParams
    seed: int | None  # of its random stream (`engine.sampler`); None when greedy
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
    # Where the output starts in `token_ids`: a continuation's prompt ends with output
    # already streamed (the penalties and `min_tokens` count it as output).
    output_start: int = -1  # -1: at num_prompt_tokens
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked
    matcher: Matcher | None = None  # its place in the grammar of a structured output
    # When it got its first blocks (an engine-wide count; -1: it holds none yet, or it was
    # preempted). The most recently admitted running sequence of the least urgent priority
    # is preempted first.
    admitted: int = -1
    priority: int = 0  # lower goes first (vLLM's); the scheduler's order

    def __post_init__(self) -> None:
        if self.output_start < 0:
            self.output_start = self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
