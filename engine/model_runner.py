"""Runs one scheduled batch through the model: synchronous, called from the engine thread.

Owns the block bookkeeping of each sequence: prefix-cache matching when a prompt is admitted,
growing block tables as sequences lengthen, registering full prompt blocks in the prefix
cache once computed, and freeing blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata, SequenceSlice
from engine.block_allocator import BlockAllocator
from engine.decode_graphs import DecodeGraphs
from engine.kv_cache import KvCache
from engine.model import CausalLM
from engine.sampler import Draw, Pick, prompt_logprobs, sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from shared.block_hash import block_hashes
from shared.messages import TokenLogprob

# Prompt positions scored at once: a pass holds its logits, their float32 log-softmax and the
# rank's comparison, each [rows, vocabulary]. Measured (peak RSS, 2048 rows of a 128k
# vocabulary, float32 logits): 3.9 GiB in one pass, 0.3 GiB in passes of 256.
SCORED_ROWS_PER_PASS = 256


@dataclass(frozen=True)
class Sampled:
    seq: Sequence
    token_id: int
    logprob: TokenLogprob
    forks: list[Pick] = field(default_factory=list)  # n > 1, first token: choices 1..n-1


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KvCache, allocator: BlockAllocator, *,
                 device: torch.device, is_prefix_caching: bool,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.eos_token_ids = eos_token_ids
        self.model = model
        self.kv = kv
        self.allocator = allocator
        self.block_size = kv.block_size
        self.device = device
        self.is_prefix_caching = is_prefix_caching
        self.graphs: DecodeGraphs | None = None  # decode steps replayed as graphs

    def admit(self, seq: Sequence) -> None:
        """Give a sequence without blocks the longest cached prefix of its prompt (a new
        prompt, or a preempted sequence computed again); the rest is allocated as its steps
        need it. At least one token is always left to compute, so the step yields logits to
        sample from. A prompt whose logprobs were asked for is computed whole (the cache
        holds K/V, not logits)."""
        if not self.is_prefix_caching:
            return
        seq.block_hashes = block_hashes(seq.token_ids[: seq.num_prompt_tokens], self.block_size)
        usable = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
        if seq.sampling.prompt_logprobs is not None and seq.num_generated == 0:
            usable = []
        seq.block_ids = self.allocator.match_prefix(usable)
        seq.num_computed = len(seq.block_ids) * self.block_size
        if seq.num_generated == 0:
            seq.num_cached = seq.num_computed
        seq.num_registered = len(seq.block_ids)

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> None:
        missing = math.ceil(num_tokens / self.block_size) - len(seq.block_ids)
        if missing > 0:
            seq.block_ids.extend(self.allocator.allocate(missing))

    def free(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks (its computed prompt blocks stay in the prefix cache)
        and forget its KV: it is computed again, prompt and output so far, when resumed."""
        self.free(seq)
        seq.num_computed = seq.num_registered = 0
        seq.admitted = -1

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[Sampled]:
        """Compute the batch's new tokens; sample for every sequence that has no uncomputed
        token left afterwards."""
        ids, positions, slots, slices = [], [], [], []
        offset = 0
        for seq, count in zip(batch.sequences, batch.num_new_tokens, strict=True):
            start = seq.num_computed
            self.ensure_blocks(seq, start + count)
            table = torch.tensor(seq.block_ids, dtype=torch.long, device=self.device)
            pos = torch.arange(start, start + count, device=self.device)
            ids.append(torch.tensor(seq.token_ids[start:start + count], dtype=torch.long,
                                    device=self.device))
            positions.append(pos)
            slots.append(self._slots(table, pos))
            slices.append(SequenceSlice(offset, count, start + count, seq.block_ids))
            offset += count
        meta = AttentionMetadata(torch.cat(slots), slices)
        # Only sequences whose prompt completes in this step: their KV is then whole per layer.
        listeners = [
            functools.partial(seq.on_layer, block_ids=list(seq.block_ids))
            for seq, count in zip(batch.sequences, batch.num_new_tokens, strict=True)
            if seq.on_layer is not None and seq.num_computed + count >= seq.num_prompt_tokens
        ]
        input_ids, input_positions = torch.cat(ids), torch.cat(positions)
        hidden = None
        if self.graphs is not None and not listeners:
            hidden = self.graphs.run(input_ids, input_positions, meta.slot_mapping, slices)
        if hidden is None:
            hidden = self.model(input_ids, input_positions, meta, self.kv,
                                on_layer=_fan_out(listeners) if listeners else None)
        return self._advance_and_sample(batch, slices, hidden)

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _advance_and_sample(self, batch: ScheduledBatch, slices: list[SequenceSlice],
                            hidden: torch.Tensor) -> list[Sampled]:
        ready: list[Sequence] = []
        rows: list[int] = []
        draws: list[Draw] = []
        for seq, count, piece in zip(batch.sequences, batch.num_new_tokens, slices, strict=True):
            if (seq.sampling.prompt_logprobs is not None and seq.num_generated == 0
                    and seq.num_computed < seq.output_start):
                self._score_prompt(seq, count, piece, hidden)
            seq.num_computed += count
            self._register_full_blocks(seq)
            if seq.num_uncomputed == 0:
                ready.append(seq)
                # A prompt's first token, for n > 1: one draw per choice, each its stream.
                num_draws = seq.sampling.n if seq.num_generated == 0 else 1
                for choice in range(num_draws):
                    rows.append(piece.query_start + piece.query_len - 1)
                    draws.append(Draw(
                        seq.sampling, None if seq.seed is None else seq.seed + choice,
                        seq.token_ids, seq.output_start, seq.matcher,
                        seq.sampling.max_tokens - seq.num_generated))
        if not ready:
            return []
        picks = iter(sample(self.model.logits(hidden[rows]), draws, self.eos_token_ids))
        sampled = []
        for seq in ready:
            pick = next(picks)
            forks = [next(picks) for _ in range(seq.sampling.n - 1)] \
                if seq.num_generated == 0 else []
            if seq.matcher is not None:
                seq.matcher.accept(pick.token_id)
            sampled.append(Sampled(seq, pick.token_id, pick.logprob, forks))
        return sampled

    def _score_prompt(self, seq: Sequence, count: int, piece: SequenceSlice,
                      hidden: torch.Tensor) -> None:
        """The logprobs of the prompt tokens this chunk predicts (position i predicts i + 1;
        the first prompt token has none)."""
        start = seq.num_computed
        if start == 0:
            seq.prompt_logprobs.append(TokenLogprob(None))
        end = min(start + count, seq.output_start - 1)  # the last position predicts output
        for begin in range(start, end, SCORED_ROWS_PER_PASS):
            stop = min(begin + SCORED_ROWS_PER_PASS, end)
            rows = hidden[piece.query_start + begin - start:piece.query_start + stop - start]
            seq.prompt_logprobs.extend(prompt_logprobs(
                self.model.logits(rows), seq.token_ids[begin + 1:stop + 1],
                seq.sampling.prompt_logprobs or 0))

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = min(seq.num_computed // self.block_size, len(seq.block_hashes))
        for index in range(seq.num_registered, full):
            self.allocator.register(seq.block_ids[index], seq.block_hashes[index])
        seq.num_registered = max(seq.num_registered, full)


def _fan_out(listeners: list[Callable[[int], None]]) -> Callable[[int], None]:
    def notify(layer: int) -> None:
        for listener in listeners:
            listener(layer)

    return notify
