"""KV blocks taken as sequences grow, and preemption by recompute when the pool runs short.

Runs in the engine thread, between model steps. A sequence holds blocks only for the tokens
computed so far (plus those of the step about to run); when the pool cannot give a running
sequence its next block, the most recently admitted running sequence (of the least urgent
priority) gives up all of its blocks and is computed again later (prompt and output so far;
its full prompt blocks stay in the prefix cache, so that is cheap). `up-front` reservation,
the engine's earlier policy and the memory benchmark's baseline, instead takes prompt +
`max_tokens` at admission.
"""

from __future__ import annotations

import itertools

from engine.block_allocator import BlockAllocator
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence
from shared.errors import CapacityExhausted


class BlockGrowth:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, allocator: BlockAllocator,
                 *, max_model_len: int, is_up_front: bool) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.is_up_front = is_up_front
        self.num_preemptions = 0
        self._admissions = itertools.count()

    def mark_admitted(self, seq: Sequence) -> None:
        """`seq` is now the most recently admitted sequence (the first to be preempted)."""
        seq.admitted = next(self._admissions)

    def secure(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """Blocks for every token the batch computes, taken as sequences grow. A prompt that
        finds none waits, and the prompts behind it too (in line's order); a running
        sequence that finds none takes them from a running one, preempted by recompute
        (possibly itself: `_victim`). What of the batch can run."""
        sequences, counts = [], []
        for seq, count in zip(batch.sequences, batch.num_new_tokens, strict=True):
            if batch.is_prefill != (seq in self.scheduler.waiting):
                continue  # preempted by an earlier sequence of this batch
            count = self._grow(seq, count, is_prefill=batch.is_prefill, secured=sequences)
            if count:
                sequences.append(seq)
                counts.append(count)
            elif batch.is_prefill:
                break
        if not sequences:
            return None
        return ScheduledBatch(sequences, counts, batch.is_prefill)

    def allocate(self, count: int, keep: Sequence) -> list[int]:
        """`count` blocks, preempting running sequences (`_victim_order`, never
        `keep`) while the pool is short; `CapacityExhausted` when none is left to take."""
        while True:
            try:
                return self.allocator.allocate(count)
            except CapacityExhausted:
                victim = self._victim(keep, is_prefill=False, secured=[keep])
                if victim is None:
                    raise
                self._preempt(victim)

    def allocate_over(self, count: int, priority: int) -> list[int]:
        """`count` blocks for work of `priority` that is not in the batch (a decode
        reservation): when the pool is short, taken from the running sequences less urgent
        than it (`_victim_order`), preempted by recompute, if they hold enough; else
        `CapacityExhausted`, and none is preempted."""
        victims = sorted((s for s in self.scheduler.running
                          if s.block_ids and s.priority > priority),
                         key=_victim_order, reverse=True)
        if self.allocator.num_available + sum(len(s.block_ids) for s in victims) < count:
            return self.allocator.allocate(count)  # raises, unless blocks freed meanwhile
        while True:
            try:
                return self.allocator.allocate(count)
            except CapacityExhausted:
                if not victims:
                    raise
                self._preempt(victims.pop(0))

    def _grow(self, seq: Sequence, count: int, *, is_prefill: bool,
              secured: list[Sequence]) -> int:
        """How many of its next `count` tokens `seq` now holds blocks for (all or none). A
        sequence without blocks first takes its cached prefix (`admit`), which may leave
        fewer to compute. A prompt takes blocks from others only from less urgent running
        sequences, or when nothing runs (`_victim`)."""
        is_first = seq.admitted < 0
        if is_first:
            self.runner.admit(seq)
            self.mark_admitted(seq)
            count = min(count, seq.num_uncomputed)
        needed = seq.num_computed + count
        if is_first and self.is_up_front and not seq.is_prefill_only:
            needed = max(needed, min(self.max_model_len,
                                     seq.num_prompt_tokens + seq.sampling.max_tokens))
        while True:
            try:
                if is_first and is_prefill and not self._leaves_room_to_grow(seq, needed):
                    raise CapacityExhausted("no room left for the running sequences to grow")
                self.runner.ensure_blocks(seq, needed)
                return count
            except CapacityExhausted:
                victim = self._victim(seq, is_prefill, secured)
                if victim is None:
                    if is_prefill and seq.num_computed == seq.num_cached:
                        self.runner.preempt(seq)  # holds nothing while it waits
                    return 0
                self._preempt(victim)
                if victim is seq:
                    return 0

    def _leaves_room_to_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether admitting `seq` leaves a free block for each running sequence (which
        would otherwise soon preempt the newcomer again)."""
        missing = -(-num_tokens // self.runner.block_size) - len(seq.block_ids)
        return self.allocator.num_available - missing >= len(self.scheduler.running)

    def _victim(self, seq: Sequence, is_prefill: bool, secured: list[Sequence]
                ) -> Sequence | None:
        """Whose blocks `seq` may take: of the running sequences not already given their
        blocks for this step, the least urgent priority's most recently admitted. A prompt
        takes only a less urgent running sequence's, and when nothing runs, those of a
        prompt after it in line that holds some (a chunked one)."""
        running = self.scheduler.running
        if not is_prefill:
            candidates = [s for s in running if s.block_ids]
        elif running:
            candidates = [s for s in running if s.block_ids and s.priority > seq.priority]
        else:
            candidates = [s for s in self.scheduler.waiting
                          if s.block_ids and _victim_order(s) > _victim_order(seq)]
        return max((s for s in candidates if s not in secured), key=_victim_order,
                   default=None)

    def _preempt(self, seq: Sequence) -> None:
        self.runner.preempt(seq)
        if seq in self.scheduler.running:
            self.scheduler.preempt(seq)
            self.num_preemptions += 1


def _victim_order(seq: Sequence) -> tuple[int, int]:
    """Preempted first: the greatest (the least urgent priority, the latest admitted)."""
    return seq.priority, seq.admitted
