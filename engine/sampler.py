"""Token sampling, one module for every worker (prefill's first token, decode's later ones):
logit controls (token filters, min_tokens, bias, penalties), greedy or temperature with
min-p, top-k and top-p, per-request seeds, and the logprobs a client asked for.

Logprobs are those of the model's own distribution (`log_softmax` of the raw logits), as
OpenAI reports them, whatever controls shaped the pick.

Randomness is addressed by position: output token i of a request with seed s is drawn from a
generator seeded with (s, i). So the same seed gives the same tokens whatever the batch, and
whichever worker draws them: prefill's first token and decode's next ones continue one
stream, after a handoff or a failover alike.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.messages import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from engine.grammar import Matcher

MAX_LOGPROBS = 20


def base_seed(params: SamplingParams, offset: int = 0) -> int | None:
    """The seed of a request's random stream (None when greedy): its own seed, or a random
    one. `offset` gives each of several streams of one request its own (`seed + offset`)."""
    if params.temperature == 0.0:
        return None
    if params.seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 1
    return params.seed + offset


@dataclass(frozen=True)
class Draw:
    """One row to sample: its controls, its random stream's seed, and its context (prompt,
    then output; the output starts at `output_start`), which the penalties and `min_tokens`
    read and whose output length picks the draw within the stream."""

    sampling: SamplingParams
    seed: int | None
    token_ids: Sequence[int]
    output_start: int
    matcher: Matcher | None = None  # the grammar the next token must keep to
    remaining: int = 1 << 30  # output tokens the budget still allows, this one included

    @property
    def budget(self) -> int:
        """The request's whole output budget: a continuation's `max_tokens` is what was left
        of it, its earlier output already in `token_ids`."""
        return self.remaining + len(self.token_ids) - self.output_start

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        position = len(self.token_ids) - self.output_start
        seed = (self.seed * 0x9E3779B97F4A7C15 + position) & 0x7FFF_FFFF_FFFF_FFFF
        return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True)
class Pick:
    token_id: int
    logprob: TokenLogprob


def sample(logits: torch.Tensor, draws: Sequence[Draw],
           eos_token_ids: Collection[int] = ()) -> list[Pick]:
    """Pick one token per row of `logits` (`[B, V]`, float32)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    shaped = logits
    controlled = [row for row, d in enumerate(draws)
                  if has_controls(d.sampling) or d.matcher is not None]
    if controlled:
        shaped = logits.clone()
        for row in controlled:
            apply_controls(shaped[row], draws[row], eos_token_ids)
    tokens = shaped.argmax(dim=-1)
    for row, draw in enumerate(draws):
        if draw.sampling.temperature > 0.0:
            tokens[row] = _sample_row(shaped[row], draw.sampling,
                                      draw.generator(logits.device))
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    picks = []
    for row, (token, logprob, draw) in enumerate(zip(tokens.tolist(), chosen, draws,
                                                      strict=True)):
        top = top_logprobs(log_probs[row], draw.sampling.logprobs)
        picks.append(Pick(token, TokenLogprob(logprob, top)))
    return picks


def top_logprobs(log_probs: torch.Tensor, count: int | None) -> list[tuple[int, float]]:
    """The `count` most likely tokens of one row of logprobs, most likely first."""
    if not count:
        return []
    values, ids = torch.topk(log_probs, min(count, log_probs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int], count: int
                    ) -> list[TokenLogprob]:
    """Row i of `logits` predicts `next_token_ids[i]`: its logprob, its rank and the top
    `count`."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(list(next_token_ids), dtype=torch.long, device=logits.device)
    chosen = log_probs.gather(1, targets.unsqueeze(1))
    ranks = (log_probs > chosen).sum(dim=1).add_(1).tolist()
    return [TokenLogprob(value, top_logprobs(log_probs[row], count), rank)
            for row, (value, rank) in enumerate(zip(chosen.squeeze(1).tolist(), ranks,
                                                     strict=True))]


def has_controls(p: SamplingParams) -> bool:
    return (bool(p.logit_bias) or p.min_tokens > 0 or p.has_penalties
            or bool(p.allowed_token_ids) or bool(p.bad_words))


def apply_controls(logits: torch.Tensor, draw: Draw, eos_token_ids: Collection[int]) -> None:
    """Shape one row of logits in place: the grammar's mask, the token filters and
    min_tokens, bias, then the penalties."""
    p = draw.sampling
    if draw.matcher is not None:
        draw.matcher.mask(logits, draw.remaining, draw.budget)
    for banned in _bans(logits, draw, eos_token_ids):
        _mask_unless_empty(logits, banned)
    if p.logit_bias:
        ids, biases = zip(*p.logit_bias, strict=True)
        logits[list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
    if not p.has_penalties:
        return
    context = torch.tensor(list(draw.token_ids), dtype=torch.long, device=logits.device)
    if p.repetition_penalty != 1.0 and len(context):
        seen = context.unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                   values * p.repetition_penalty)
    output = context[draw.output_start:]
    if (p.frequency_penalty or p.presence_penalty) and len(output):
        counts = torch.bincount(output, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= counts * p.frequency_penalty + (counts > 0).to(logits.dtype) \
            * p.presence_penalty


def _bans(logits: torch.Tensor, draw: Draw, eos_token_ids: Collection[int]
          ) -> Iterator[torch.Tensor]:
    """The masks (True: banned) of one row, in order: outside `allowed_token_ids`, the
    bad words' next tokens, eos and stop tokens before `min_tokens`."""
    p = draw.sampling
    if p.allowed_token_ids:
        outside = torch.ones_like(logits, dtype=torch.bool)
        outside[list(p.allowed_token_ids)] = False
        yield outside
    num_output = len(draw.token_ids) - draw.output_start
    if completing := [word[-1] for word in p.bad_words
                      if _output_ends_with(draw.token_ids, num_output, word[:-1])]:
        yield _mask_of(logits, completing)
    if num_output < p.min_tokens:
        ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
        if ends:
            yield _mask_of(logits, ends)


def _output_ends_with(token_ids: Sequence[int], num_output: int, prefix: tuple[int, ...]
                      ) -> bool:
    """Whether the last `num_output` of `token_ids` (the output) end with `prefix`."""
    return not prefix or (num_output >= len(prefix)
                          and tuple(token_ids[len(token_ids) - len(prefix):]) == prefix)


def _mask_of(logits: torch.Tensor, token_ids: Collection[int]) -> torch.Tensor:
    banned = torch.zeros_like(logits, dtype=torch.bool)
    banned[sorted(token_ids)] = True
    return banned


def _mask_unless_empty(logits: torch.Tensor, banned: torch.Tensor) -> None:
    """Mask `banned` in place unless no token would be left to draw (a filter that bans what
    the grammar alone allows, an eos the only token allowed): a pick beats an empty row."""
    masked = logits.masked_fill(banned, float("-inf"))
    if bool(torch.isfinite(masked).any()):
        logits.copy_(masked)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
                ) -> torch.Tensor:
    probs = torch.softmax(warp(logits, p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row scaled by temperature (> 0), the tokens that min-p, top-k and top-p leave out
    at -inf."""
    scaled = logits / p.temperature
    if p.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_k is not None and p.top_k < scaled.shape[-1]:
        threshold = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    if p.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # Drop a token once the tokens before it already reach top_p; the first one stays
        # (top_p 0 leaves it alone).
        drop = (cumulative - torch.softmax(ordered, dim=-1)) >= p.top_p
        drop[0] = False
        scaled = scaled.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    return scaled
