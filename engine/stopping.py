"""When a request stops generating: one rule for every engine."""

from __future__ import annotations

from collections.abc import Collection

from shared.messages import FinishReason, SamplingParams


def finish_reason(
    token_id: int, num_generated: int, sampling: SamplingParams, eos_token_ids: Collection[int]
) -> FinishReason | None:
    """The finish reason after emitting `token_id` as output token number `num_generated`
    (1-based), or None to go on. A stop token wins over the length limit."""
    if token_id in sampling.stop_token_ids:
        return "stop"
    if token_id in eos_token_ids and not sampling.ignore_eos:
        return "stop"
    if num_generated >= sampling.max_tokens:
        return "length"
    return None
