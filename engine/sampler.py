"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen logprobs."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from shared.messages import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A per-request generator: the same seed gives the same tokens whatever the batch."""
    if params.temperature == 0.0:
        return None
    generator = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    generator.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` (`[B, V]`, float32). Returns the tokens and the
    log-probability of each under the model's unmodified distribution."""
    log_probs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.temperature > 0.0:
            tokens[row] = _sample_row(logits[row], p, generator)
    chosen = log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), chosen.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None
                ) -> torch.Tensor:
    scaled = logits / p.temperature
    if p.top_k is not None and p.top_k < scaled.shape[-1]:
        threshold = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    if p.top_p < 1.0:
        ordered, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # Drop a token once the tokens before it already reach top_p (the first one stays).
        drop = (cumulative - torch.softmax(ordered, dim=-1)) >= p.top_p
        scaled = scaled.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]
