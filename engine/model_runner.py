"""Runs one scheduled batch through the model: synchronous, called from the engine thread.

Owns the block bookkeeping of each sequence: prefix-cache matching when a prompt is admitted,
growing block tables as sequences lengthen, registering full prompt blocks in the prefix
cache once computed, and freeing blocks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.block_allocator import BlockAllocator
from engine.kv_cache import KvCache
from engine.model import AttentionMetadata, CausalLM, SequenceSlice
from engine.sampler import sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from shared.block_hash import block_hashes


@dataclass(frozen=True)
class Sampled:
    seq: Sequence
    token_id: int
    logprob: float


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KvCache, allocator: BlockAllocator, *,
                 device: torch.device, is_prefix_caching: bool) -> None:
        self.model = model
        self.kv = kv
        self.allocator = allocator
        self.block_size = kv.block_size
        self.device = device
        self.is_prefix_caching = is_prefix_caching

    def admit(self, seq: Sequence, num_reserved_tokens: int) -> None:
        """Give a new prompt its blocks, reusing the longest cached prefix, and reserve room
        for `num_reserved_tokens` in all: with no preemption, a request that was admitted
        never runs out of blocks mid-generation. At least one token is always left to
        compute, so the step yields logits to sample from."""
        if self.is_prefix_caching:
            seq.block_hashes = block_hashes(seq.token_ids[: seq.num_prompt_tokens],
                                            self.block_size)
            usable = seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]
            seq.block_ids = self.allocator.match_prefix(usable)
            seq.num_computed = seq.num_cached = len(seq.block_ids) * self.block_size
            seq.num_registered = len(seq.block_ids)
        try:
            self.ensure_blocks(seq, max(seq.num_tokens, num_reserved_tokens))
        except BaseException:
            self.free(seq)
            raise

    def ensure_blocks(self, seq: Sequence, num_tokens: int) -> None:
        missing = math.ceil(num_tokens / self.block_size) - len(seq.block_ids)
        if missing > 0:
            seq.block_ids.extend(self.allocator.allocate(missing))

    def free(self, seq: Sequence) -> None:
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[Sampled]:
        """Compute the batch's new tokens; sample for every sequence that has no uncomputed
        token left afterwards."""
        ids, positions, slots, contexts, slices = [], [], [], [], []
        offset = context_offset = 0
        for seq, count in zip(batch.sequences, batch.num_new_tokens, strict=True):
            start = seq.num_computed
            self.ensure_blocks(seq, start + count)
            table = torch.tensor(seq.block_ids, dtype=torch.long, device=self.device)
            pos = torch.arange(start, start + count, device=self.device)
            ids.append(torch.tensor(seq.token_ids[start:start + count], dtype=torch.long,
                                    device=self.device))
            positions.append(pos)
            slots.append(self._slots(table, pos))
            context_start = context_slot = None
            if start > 0 and self._is_contiguous(seq.block_ids, start + count):
                context_slot = seq.block_ids[0] * self.block_size  # read in place, no copy
            elif start > 0:  # a cached context to gather: prefix, earlier chunks, or decode
                contexts.append(self._slots(table, torch.arange(start + count,
                                                                device=self.device)))
                context_start, context_offset = context_offset, context_offset + start + count
            slices.append(SequenceSlice(offset, count, start + count, context_start,
                                        context_slot))
            offset += count
        meta = AttentionMetadata(torch.cat(slots), slices,
                                 torch.cat(contexts) if contexts else None)
        # Only sequences whose prompt completes in this step: their KV is then whole per layer.
        listeners = [
            functools.partial(seq.on_layer, block_ids=list(seq.block_ids))
            for seq, count in zip(batch.sequences, batch.num_new_tokens, strict=True)
            if seq.on_layer is not None and seq.num_computed + count >= seq.num_prompt_tokens
        ]
        hidden = self.model(torch.cat(ids), torch.cat(positions), meta, self.kv,
                            on_layer=_fan_out(listeners) if listeners else None)
        return self._advance_and_sample(batch, slices, hidden)

    def _is_contiguous(self, block_ids: list[int], num_tokens: int) -> bool:
        used = -(-num_tokens // self.block_size)
        return block_ids[:used] == list(range(block_ids[0], block_ids[0] + used))

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _advance_and_sample(self, batch: ScheduledBatch, slices: list[SequenceSlice],
                            hidden: torch.Tensor) -> list[Sampled]:
        ready: list[Sequence] = []
        rows: list[int] = []
        for seq, count, piece in zip(batch.sequences, batch.num_new_tokens, slices, strict=True):
            seq.num_computed += count
            self._register_full_blocks(seq)
            if seq.num_uncomputed == 0:
                ready.append(seq)
                rows.append(piece.query_start + piece.query_len - 1)
        if not ready:
            return []
        logits = self.model.logits(hidden[rows])
        tokens, logprobs = sample(logits, [s.sampling for s in ready],
                                  [s.generator for s in ready])
        return [Sampled(s, t, lp) for s, t, lp in zip(ready, tokens, logprobs, strict=True)]

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
