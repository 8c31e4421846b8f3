"""Placement policies: pure functions of the cluster view, tested without NATS.

Prefill policies (`PrefillPolicy`):
  least-loaded  fewest running + waiting requests per batch slot;
  round-robin   the next worker in id order (for comparison);
  cache-aware   least estimated work: the prompt blocks a worker would still have to compute
                (its cached prefix, from the global prefix index, is free) times (1 + load).
Decode: the least-loaded worker with KV room for prompt + max_tokens.

`pending` counts work this conductor sent a worker since that worker's last heartbeat, so a
burst between two heartbeats spreads instead of piling on one worker. Ties go to the lowest
worker id, so every conductor replica with the same view agrees.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from shared.errors import CapacityExhausted, WorkerUnavailable
from shared.messages import WorkerHeartbeat


@dataclass(frozen=True)
class PendingWork:
    """Work sent to a worker since its last heartbeat."""

    num_requests: int = 0
    num_blocks: int = 0


PrefillPolicy = Literal["least-loaded", "round-robin", "cache-aware"]


@dataclass(frozen=True)
class PrefixView:
    """What the prefix index says about one prompt: its block count and, per worker, how
    many of its leading blocks that worker holds."""

    num_blocks: int = 0
    cached_blocks: Mapping[str, int] = field(default_factory=dict)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(num_tokens / block_size))


def _load(worker: WorkerHeartbeat, pending: PendingWork) -> float:
    busy = worker.num_running + worker.num_waiting + pending.num_requests
    return busy / max(1, worker.max_batch_size)


def pick_prefill(
    workers: Sequence[WorkerHeartbeat],
    excluded: Collection[str],
    pending: Mapping[str, PendingWork],
    *,
    policy: PrefillPolicy = "least-loaded",
    prefix: PrefixView | None = None,
    turn: int = 0,
) -> WorkerHeartbeat:
    """The healthy prefill worker, not in `excluded`, that `policy` prefers."""
    candidates = sorted((w for w in workers if w.worker_id not in excluded),
                        key=lambda w: w.worker_id)
    if not candidates:
        raise WorkerUnavailable("no healthy prefill worker")

    def load(w: WorkerHeartbeat) -> float:
        return _load(w, pending.get(w.worker_id, PendingWork()))

    match policy:
        case "round-robin":
            return candidates[turn % len(candidates)]
        case "cache-aware" if prefix is not None:
            def work(w: WorkerHeartbeat) -> float:
                uncached = prefix.num_blocks - prefix.cached_blocks.get(w.worker_id, 0)
                return uncached * (1.0 + load(w))

            return min(candidates, key=lambda w: (work(w), load(w), w.worker_id))
        case _:
            return min(candidates, key=lambda w: (load(w), w.worker_id))


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

    room = {w.worker_id: free_after(w) for w in candidates}
    roomy = [w for w in candidates if room[w.worker_id] >= 0]
    if not roomy:
        raise CapacityExhausted(f"no decode worker has KV room for {num_tokens} tokens")
    return min(roomy, key=lambda w: (_load(w, pending.get(w.worker_id, PendingWork())),
                                     -room[w.worker_id], w.worker_id))
