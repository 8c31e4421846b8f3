"""`TokenBatch` messages that fit a NATS message (the server's `max_payload`, 1 MiB unless it
says otherwise).

A batch that fits (a decode step's tokens, a first token) goes as one message, encoded once.
One that does not (a long prompt's `prompt_logprobs`: 2,000 tokens with 20 alternatives each
are ~1.05 MB of JSON) is split between its deltas, and a delta too large alone is split too:
its output tokens into consecutive deltas, each with the `index` where its tokens begin (the
gateway orders deltas by it anyway), and its prompt's logprobs into deltas that carry a piece
of them and no token, ahead of the delta of the first token, which carries the last piece.
The gateway joins the pieces (`services/gateway/generation.py`). One publisher, one subject:
they arrive in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import msgspec

from shared.messages import TokenBatch, TokenDelta
from shared.nats_client import encode

ENVELOPE_BYTES = 128  # a batch's own fields around its deltas (its worker id apart)

T = TypeVar("T")


def encoded_batches(worker_id: str, items: list[TokenDelta], max_bytes: int) -> list[bytes]:
    """`items` as encoded `TokenBatch`es of at most `max_bytes` each, in order."""
    whole = encode(TokenBatch(worker_id=worker_id, items=items))
    if len(whole) <= max_bytes:
        return [whole]
    budget = max_bytes - ENVELOPE_BYTES - len(worker_id)
    parts = [part for delta in items for part in _parts(delta, budget)]
    return [encode(TokenBatch(worker_id=worker_id, items=group))
            for group in _runs(parts, budget)]


def is_prompt_piece(delta: TokenDelta) -> bool:
    """A piece of a prompt's logprobs sent ahead of its first token (no token of its own)."""
    return not delta.token_ids and delta.prompt_logprobs is not None \
        and delta.finish_reason is None


def _parts(delta: TokenDelta, budget: int) -> list[TokenDelta]:
    """`delta` as deltas that each encode within `budget` bytes: prompt pieces first, then
    its tokens in runs. Half the budget each for a run of tokens and a piece of the prompt,
    so that the first run carries the last piece within it."""
    if len(msgspec.json.encode(delta)) <= budget:
        return [delta]
    half = budget // 2
    last_piece = delta.prompt_logprobs
    parts = []
    if delta.prompt_logprobs is not None:
        *ahead, last_piece = _runs(delta.prompt_logprobs, half)
        parts = [TokenDelta(request_id=delta.request_id, index=delta.index, token_ids=[],
                            prompt_logprobs=piece) for piece in ahead]
    logprobs = delta.logprobs
    tokens = list(zip(delta.token_ids, logprobs or [None] * len(delta.token_ids),
                      strict=True))
    runs = _runs(tokens, half)
    offset = 0
    for number, run in enumerate(runs):
        parts.append(TokenDelta(
            request_id=delta.request_id, index=delta.index + offset,
            token_ids=[token for token, _ in run],
            finish_reason=delta.finish_reason if number == len(runs) - 1 else None,
            num_cached_tokens=delta.num_cached_tokens,
            logprobs=None if logprobs is None else [entry for _, entry in run if entry],
            prompt_logprobs=last_piece if number == 0 else None))
        offset += len(run)
    return parts


def _runs(entries: Sequence[T], budget: int) -> list[list[T]]:
    """`entries` in consecutive runs, each encoding within `budget` bytes (one entry at least
    a run); one empty run for no entries."""
    runs: list[list[T]] = [[]]
    size = 0
    for entry in entries:
        entry_size = len(msgspec.json.encode(entry)) + 1
        if runs[-1] and size + entry_size > budget:
            runs.append([])
            size = 0
        runs[-1].append(entry)
        size += entry_size
    return runs
