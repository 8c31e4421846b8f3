"""Which sequences run in the next model step: plain data in, plain data out.

Prefill (dynamic batching): waiting sequences are taken first come, first served until the
token budget `max_batch_tokens` or `max_batch_size` is reached; a prompt larger than what is
left of the budget is cut into chunks (chunked prefill) and finished over later steps. The
batch is flattened (no padding at all), so sorting by length would buy nothing; FIFO keeps it
fair. Decode (continuous batching): every running sequence advances one token per step, and
sequences join and leave between steps.

When both kinds wait, decode runs unless prefill is due: the first waiting prompt has waited
`max_wait_s`, or the waiting prompts fill the token budget. An engine with nothing to decode
starts a prefill at once (waiting would only add latency). A preempted sequence (its blocks
taken for others) waits first in line.

Priorities (a request's `priority`, vLLM's: lower goes first; 0 unless the gateway's
scheduling policy lets clients set it) order both queues: a prompt waits behind every prompt
of its priority or a more urgent one, ahead of the less urgent (a preempted sequence first
among its own priority), and a decode step past `max_batch_size` takes the most urgent
sequences, those of one priority taking turns. With one priority the order is arrival's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.sequence import Sequence


@dataclass(frozen=True)
class ScheduledBatch:
    sequences: list[Sequence]
    num_new_tokens: list[int]
    is_prefill: bool


class Scheduler:
    def __init__(self, *, max_batch_tokens: int, max_batch_size: int, max_wait_s: float) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add_waiting(self, seq: Sequence) -> None:
        """At the back of its priority's place in line."""
        self.waiting.insert(_place(self.waiting, lambda queued: queued > seq.priority), seq)

    def add_running(self, seq: Sequence) -> None:
        self.running.append(seq)

    def remove(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return seq
        return None

    def discard(self, seq: Sequence) -> bool:
        """Take this very sequence out (not another of its request id); whether it was in."""
        for queue in (self.waiting, self.running):
            for index, queued in enumerate(queue):
                if queued is seq:
                    del queue[index]
                    return True
        return False

    def schedule(self, now_s: float) -> ScheduledBatch | None:
        if self.waiting and (not self.running or self._is_prefill_due(now_s)):
            return self._prefill_batch()
        return self.decode_batch()

    def decode_batch(self) -> ScheduledBatch | None:
        """The next decode step's sequences (also when the prefill due cannot run)."""
        if not self.running:
            return None
        self.running.sort(key=_priority)  # stable: each priority's turns kept
        batch = self.running[: self.max_batch_size]
        # Rotate so that, past max_batch_size, every sequence of a priority gets its turn.
        self.running = self.running[self.max_batch_size:] + batch
        return ScheduledBatch(batch, [1] * len(batch), is_prefill=False)

    def preempt(self, seq: Sequence) -> None:
        """A running sequence gives its blocks up: it waits first in line (of its
        priority) to be computed again (prompt and output so far), then decodes on."""
        self.running.remove(seq)
        self.waiting.insert(_place(self.waiting, lambda queued: queued >= seq.priority), seq)

    def _is_prefill_due(self, now_s: float) -> bool:
        if now_s - self.waiting[0].arrived_at_s >= self.max_wait_s:
            return True
        return sum(s.num_uncomputed for s in self.waiting) >= self.max_batch_tokens

    def _prefill_batch(self) -> ScheduledBatch:
        budget = self.max_batch_tokens
        sequences, counts = [], []
        for seq in self.waiting:
            if budget == 0 or len(sequences) == self.max_batch_size:
                break
            take = min(seq.num_uncomputed, budget)
            sequences.append(seq)
            counts.append(take)
            budget -= take
        return ScheduledBatch(sequences, counts, is_prefill=True)

    def finish_prefill(self, seq: Sequence) -> None:
        """`seq`'s prompt is fully computed: it leaves the waiting queue."""
        self.waiting.remove(seq)


def _priority(seq: Sequence) -> int:
    return seq.priority


def _place(queue: deque[Sequence], goes_after: Callable[[int], bool]) -> int:
    """The index of the first queued sequence whose priority `goes_after` the newcomer."""
    return next((i for i, queued in enumerate(queue) if goes_after(queued.priority)),
                len(queue))
