"""Placement policies: pure functions of the cluster view, tested without NATS.

Prefill policies (`PrefillPolicy`):
  least-loaded  fewest running + waiting requests per batch slot;
  round-robin   the next worker in id order (for comparison);
  cache-aware   least estimated work: the prompt blocks a worker would still have to compute
                (its cached prefix, from the global prefix index, is free) times (1 + load);
  seed          least predicted TTFT stretched by the seed's weighted score (`cost_model`);
  longest-prefix  the worker holding the longest cached prefix, whatever its load (the oracle
                the prefix-reuse evaluation compares against), then least loaded.
Prefix reuse (`prefix_source`): once a prefill worker is chosen, the worker holding the longest
cached prefix, if longer than the chosen one's and fetching it pays (`reuse_benefit_s`).
Decode: among workers with KV room for prompt + max_tokens, the least predicted time between
tokens once the request joins (measured step time grown with the batch), then least loaded.

`pending` counts work this conductor sent a worker since that worker's last heartbeat, so a
burst between two heartbeats spreads instead of piling on one worker. Ties go to the lowest
worker id, so every conductor replica with the same view agrees.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from services.conductor.cost_model import (
    TransferCost,
    predicted_ttft_s,
    reuse_benefit_s,
    seed_score,
)
from services.conductor.prefix_index import PrefixIndex
from shared.block_hash import block_hashes
from shared.config import PrefillPolicy
from shared.errors import KvNeverFits, KvShortage, NoHealthyWorker, PrefillQueuesFull
from shared.messages import PrefixSource, WorkerHeartbeat


@dataclass(frozen=True)
class PendingWork:
    """Work sent to a worker since its last heartbeat."""

    num_requests: int = 0
    num_blocks: int = 0  # decode: KV blocks promised
    num_prefill_tokens: int = 0  # prefill: uncached prompt tokens queued


@dataclass(frozen=True)
class PrefixView:
    """What the prefix index says about one prompt: its block count and, per worker, how
    many of its leading blocks that worker holds."""

    num_blocks: int = 0
    cached_blocks: Mapping[str, int] = field(default_factory=dict)


def prefix_view(prompt_token_ids: Sequence[int], workers: Sequence[WorkerHeartbeat],
                index: PrefixIndex, *, policy: PrefillPolicy, is_fetch_enabled: bool
                ) -> PrefixView | None:
    """What `index` says about a prompt for these prefill workers; None when the policy
    does not look (load-only policies, unless a prefix may be fetched from a peer)."""
    is_fetchable = is_fetch_enabled and any(w.kv_bytes_per_block for w in workers)
    if not workers or (policy in ("least-loaded", "round-robin") and not is_fetchable):
        return None
    # Workers of one cluster share a block size; hash with the first one's.
    hashes = block_hashes(prompt_token_ids, workers[0].block_size)
    cached = index.leading_blocks(hashes, [w.worker_id for w in workers])
    return PrefixView(num_blocks=len(hashes), cached_blocks=cached)


@dataclass(frozen=True)
class SeedInputs:
    """What the seed policy needs beyond the prefix view."""

    num_prompt_tokens: int
    block_size: int
    decode_zone: str = ""
    default_tokens_per_s: float = 2000.0
    priority: int = 0  # the request's: it waits behind its own and the more urgent


FREE_WATERMARK = 0.02  # of a decode worker's blocks, kept free for its requests to grow


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(num_tokens / block_size))


_NO_PENDING = PendingWork()


def _load(worker: WorkerHeartbeat, pending: Mapping[str, PendingWork]) -> float:
    extra = pending.get(worker.worker_id, _NO_PENDING).num_requests
    return (worker.num_running + worker.num_waiting + extra) / max(1, worker.max_batch_size)


def pick_prefill(
    workers: Sequence[WorkerHeartbeat],
    excluded: Collection[str],
    pending: Mapping[str, PendingWork],
    *,
    policy: PrefillPolicy = "least-loaded",
    prefix: PrefixView | None = None,
    turn: int = 0,
    seed: SeedInputs | None = None,
) -> WorkerHeartbeat:
    """The healthy prefill worker, not in `excluded` and with room in its queue, that
    `policy` prefers."""
    candidates = [w for w in workers if w.worker_id not in excluded]
    if not candidates:
        raise NoHealthyWorker("no healthy prefill worker", role="prefill")
    candidates = [w for w in candidates if _has_queue_room(w, pending)]
    if not candidates:
        raise PrefillQueuesFull("every prefill worker's queue is full now")
    match policy:
        case "round-robin":
            candidates.sort(key=lambda w: w.worker_id)
            return candidates[turn % len(candidates)]
        case "cache-aware" if prefix is not None:
            cached, num_blocks = prefix.cached_blocks, prefix.num_blocks

            def work(w: WorkerHeartbeat) -> tuple[float, float, str]:
                load = _load(w, pending)
                uncached = num_blocks - cached.get(w.worker_id, 0)
                return uncached * (1.0 + load), load, w.worker_id

            return min(candidates, key=work)
        case "longest-prefix" if prefix is not None:
            return min(candidates, key=lambda w: (-prefix.cached_blocks.get(w.worker_id, 0),
                                                  _load(w, pending), w.worker_id))
        case "seed" if seed is not None:
            fastest = max(w.compute_score for w in candidates)
            view = prefix or PrefixView()
            return min(candidates, key=lambda w: (
                seed_cost(w, fastest, pending, view, seed), w.worker_id))
        case _:
            return min(candidates, key=lambda w: (_load(w, pending), w.worker_id))


def _has_queue_room(worker: WorkerHeartbeat, pending: Mapping[str, PendingWork]) -> bool:
    """Whether the worker queues one more prefill (it refuses past `max_queue`; 0: it did
    not say), counting what was sent to it since its heartbeat."""
    sent = pending.get(worker.worker_id, _NO_PENDING).num_requests
    return worker.max_queue <= 0 or worker.num_waiting + sent < worker.max_queue


def seed_cost(worker: WorkerHeartbeat, fastest: float, pending: Mapping[str, PendingWork],
              prefix: PrefixView, seed: SeedInputs) -> float:
    """Predicted TTFT x (2 - seed score); see `cost_model`."""
    cached_blocks = prefix.cached_blocks.get(worker.worker_id, 0)
    uncached = max(1, seed.num_prompt_tokens - cached_blocks * seed.block_size)
    queued = pending.get(worker.worker_id, _NO_PENDING).num_prefill_tokens
    ttft = predicted_ttft_s(worker, uncached + queued, seed.default_tokens_per_s,
                            priority=seed.priority)
    score = seed_score(
        worker, load=_load(worker, pending),
        max_queue=worker.max_queue or 4 * worker.max_batch_size,
        fastest=fastest, decode_zone=seed.decode_zone)
    return ttft * (2.0 - score)


def prefix_source(chosen: WorkerHeartbeat, workers: Sequence[WorkerHeartbeat],
                  prefix: PrefixView, transfer: TransferCost, default_tokens_per_s: float
                  ) -> PrefixSource | None:
    """The worker `chosen` should fetch its cached prefix from, or None (see module doc)."""
    cached = prefix.cached_blocks
    holders = [w for w in workers if w.worker_id != chosen.worker_id
               and w.kv_bytes_per_block == chosen.kv_bytes_per_block > 0]
    if not holders:
        return None
    holder = min(holders, key=lambda w: (-cached.get(w.worker_id, 0), w.worker_id))
    num_blocks = cached.get(holder.worker_id, 0)
    extra = num_blocks - cached.get(chosen.worker_id, 0)
    if extra <= 0:
        return None
    benefit = reuse_benefit_s(chosen, extra * chosen.block_size,
                              extra * chosen.kv_bytes_per_block, transfer, default_tokens_per_s)
    return PrefixSource(worker_id=holder.worker_id, num_blocks=num_blocks) if benefit > 0 \
        else None


def _decode_work_s(worker: WorkerHeartbeat, pending: Mapping[str, PendingWork],
                   unmeasured_step_s: float) -> float:
    """The step time times the requests the worker holds once this one joins: on equal
    hardware the emptier worker, across hardware the faster one per sequence. (Not the
    predicted step time: with a fixed part in every step, as on a memory-bound GPU, that
    grows least on the fullest worker and would pile every request onto it.) A worker that
    has not decoded yet, e.g. a colocated one busy prefilling, counts at `unmeasured_step_s`,
    not at zero."""
    extra = pending.get(worker.worker_id, _NO_PENDING).num_requests
    step_s = worker.decode_step_s or unmeasured_step_s
    return step_s * (worker.num_running + worker.num_waiting + extra + 1)


def _blocks_wanted(worker: WorkerHeartbeat, num_tokens: int) -> int:
    """Free blocks a decode worker needs for `num_tokens`: theirs, and the growth watermark."""
    return blocks_needed(num_tokens, worker.block_size) + math.ceil(
        FREE_WATERMARK * worker.num_total_blocks)


def _blocks_to_take(worker: WorkerHeartbeat, priority: int) -> int:
    """Blocks a request of `priority` may take from the worker's less urgent ones."""
    return sum(blocks for held_by, blocks in worker.kv_blocks_by_priority.items()
               if held_by > priority)


def pick_decode(
    workers: Sequence[WorkerHeartbeat],
    excluded: Collection[str],
    pending: Mapping[str, PendingWork],
    num_tokens: int,
    priority: int = 0,
) -> WorkerHeartbeat:
    """The least-loaded healthy decode worker with room for `num_tokens` of KV and, since
    its running requests grow, a watermark of free blocks (`FREE_WATERMARK` of its pool)
    left after them. Blocks of running requests less urgent than `priority` count as room
    (its reservation preempts them)."""
    candidates = [w for w in workers if w.worker_id not in excluded]
    if not candidates:
        raise NoHealthyWorker("no healthy decode worker", role="decode")

    measured = [w.decode_step_s for w in candidates if w.decode_step_s > 0]
    unmeasured_step_s = sum(measured) / len(measured) if measured else 1.0
    best: tuple[float, float, int, str] | None = None
    chosen = None
    for worker in candidates:
        room = (worker.num_free_blocks - pending.get(worker.worker_id, _NO_PENDING).num_blocks
                - _blocks_wanted(worker, num_tokens) + _blocks_to_take(worker, priority))
        key = (_decode_work_s(worker, pending, unmeasured_step_s), _load(worker, pending), -room,
               worker.worker_id)
        if room >= 0 and (best is None or key < best):
            best, chosen = key, worker
    if chosen is None:
        if any(_blocks_wanted(w, num_tokens) <= w.num_total_blocks for w in candidates):
            raise KvShortage(f"no decode worker has KV room for {num_tokens} tokens now")
        raise KvNeverFits(f"{num_tokens} tokens need more KV than any decode worker's "
                          "whole pool")
    return chosen
