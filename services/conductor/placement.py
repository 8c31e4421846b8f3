"""Placement policies: pure functions of the cluster view, tested without NATS.

Least-loaded for now. `pending` counts work this conductor sent a worker since that worker's
last heartbeat, so a burst between two heartbeats spreads instead of piling on one worker.
Ties go to the lowest worker id, so every conductor replica with the same view agrees.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from shared.errors import CapacityExhausted, WorkerUnavailable
from shared.messages import WorkerHeartbeat


@dataclass(frozen=True)
class PendingWork:
    """Work sent to a worker since its last heartbeat."""

    num_requests: int = 0
    num_blocks: int = 0


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(num_tokens / block_size))


def _load(worker: WorkerHeartbeat, pending: PendingWork) -> float:
    busy = worker.num_running + worker.num_waiting + pending.num_requests
    return busy / max(1, worker.max_batch_size)


def pick_prefill(
    workers: Sequence[WorkerHeartbeat],
    excluded: Collection[str],
    pending: Mapping[str, PendingWork],
) -> WorkerHeartbeat:
    """The least-loaded healthy prefill worker not in `excluded`."""
    candidates = [w for w in workers if w.worker_id not in excluded]
    if not candidates:
        raise WorkerUnavailable("no healthy prefill worker")
    return min(candidates,
               key=lambda w: (_load(w, pending.get(w.worker_id, PendingWork())), w.worker_id))


def pick_decode(
    workers: Sequence[WorkerHeartbeat],
    excluded: Collection[str],
    pending: Mapping[str, PendingWork],
    num_tokens: int,
) -> WorkerHeartbeat:
    """The least-loaded healthy decode worker with room for `num_tokens` of KV."""
    candidates = [w for w in workers if w.worker_id not in excluded]
    if not candidates:
        raise WorkerUnavailable("no healthy decode worker")

    def free_after(worker: WorkerHeartbeat) -> int:
        already = pending.get(worker.worker_id, PendingWork()).num_blocks
        return worker.num_free_blocks - already - blocks_needed(num_tokens, worker.block_size)

    roomy = [w for w in candidates if free_after(w) >= 0]
    if not roomy:
        raise CapacityExhausted(f"no decode worker has KV room for {num_tokens} tokens")
    return min(roomy, key=lambda w: (_load(w, pending.get(w.worker_id, PendingWork())),
                                     -free_after(w), w.worker_id))
