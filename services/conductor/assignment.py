"""Placing one request: pure decisions, one attempt at a time, tested without NATS.

The conductor's loop (`service.py`) asks `plan()` for an attempt, sends the attempt's
commands at once, and records each reply in the request's `Progress`; it stops when
`Progress.is_complete`, or after `max_placement_attempts`. The same loop serves both paths:
  disaggregated  a prefill worker (`PrefillTask`) and a decode worker (`DecodeReservation`);
                 a side that accepted is kept, only a refusing or vanished side is chosen
                 again, and a new prefill worker means decode is told again (it re-sends its
                 `KvTarget` to the new one); a worker given up that may hold the request
                 (`Progress.given_up`) is told, alone, to drop it;
  local          one decode worker prefills the prompt itself (`is_local_prefill`): colocated
                 workers, or a prompt under its `local_prefill_max_tokens`.
`admit()` is the SLO check on the first attempt's choice: reject early rather than serve
late. Which worker each side gets is `placement.py`'s business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.conductor.cost_model import (
    Slo,
    TransferCost,
    check_slo,
    predicted_tbt_s,
    predicted_ttft_s,
)
from services.conductor.placement import (
    PendingWork,
    PrefixView,
    SeedInputs,
    blocks_needed,
    pick_decode,
    pick_prefill,
    prefix_source,
)
from shared.config import ConductorConfig, PrefillPolicy
from shared.errors import HalfmoonError
from shared.messages import (
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    PrefillTask,
    PrefixSource,
    WorkerHeartbeat,
    WorkerRole,
)

Path = Literal["disaggregated", "local"]

# An idle prefill worker whose fit no step renewed for this long takes a request whatever
# the fit predicts (`admit`). A fresh cluster's first prefills, run while every process of
# the host warmed up, fitted 1 s + 0.8 ms a token where a warm step takes 0.06 ms, and
# refused every request after them for good; now for 2 s, and a worker slow for real gets
# one request at a time.
STALE_FIT_S = 2.0


@dataclass(frozen=True)
class Rules:
    """The conductor's placement settings."""

    policy: PrefillPolicy = "cache-aware"
    is_prefix_fetch: bool = True
    transfer_cost: TransferCost = field(default_factory=lambda: TransferCost(2e9, 0.002))
    default_prefill_tokens_per_s: float = 2000.0
    slo: Slo = field(default_factory=Slo)

    @classmethod
    def from_config(cls, config: ConductorConfig) -> Rules:
        return cls(
            policy=config.policy, is_prefix_fetch=config.prefix_fetch,
            transfer_cost=TransferCost(config.transfer_bytes_per_s, config.transfer_overhead_s),
            default_prefill_tokens_per_s=config.default_prefill_tokens_per_s,
            slo=Slo(ttft_s=_seconds(config.ttft_slo_ms), tbt_s=_seconds(config.tbt_slo_ms)))


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


@dataclass(frozen=True)
class ClusterView:
    """The healthy workers of each role, what was sent them since their last heartbeat, and
    every known worker by id (a kept side is looked up here, healthy or not: it already
    holds the request)."""

    prefill: Sequence[WorkerHeartbeat]
    decode: Sequence[WorkerHeartbeat]
    pending: Mapping[str, PendingWork]
    known: Callable[[str | None], WorkerHeartbeat | None]


@dataclass(frozen=True)
class Send:
    """One command of an attempt; `num_tokens`/`num_prefill_tokens` are what it adds to the
    worker's pending work once sent (KV room, prompt tokens to compute)."""

    role: WorkerRole
    worker: WorkerHeartbeat
    message: PrefillTask | DecodeReservation
    num_tokens: int = 0
    num_prefill_tokens: int = 0


@dataclass(frozen=True)
class Plan:
    path: Path
    prefill: WorkerHeartbeat
    decode: WorkerHeartbeat
    source: PrefixSource | None
    sends: tuple[Send, ...]


@dataclass
class Progress:
    """One request's placement so far: the sides that accepted, the workers that refused."""

    kept: dict[WorkerRole, str] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)
    num_attempts: int = 0
    num_sent: int = 0  # commands sent, each recorded with its reply (or why none came)
    delivery: int = 0  # the JetStream delivery of the request placed (0: from none)
    # Workers that may hold the request though they are no longer part of its placement,
    # not yet told (each alone) to drop it: see `record`.
    given_up: list[str] = field(default_factory=list)
    # Workers given up so far: each refuses this delivery's commands from then on.
    num_given_up: int = 0

    def record(self, send: Send, reply: DispatchReply | HalfmoonError) -> bool:
        """Whether `send` was accepted; a refusal excludes its worker from later attempts.
        A kept side that refuses (a decode worker told of a new prefill worker) is no longer
        kept: it never named its blocks to the new one. It, and a worker that never answered
        (it may have accepted late), is given up."""
        worker_id = send.worker.worker_id
        self.num_sent += 1
        if isinstance(reply, DispatchReply) and reply.is_accepted:
            self.kept[send.role] = worker_id
            return True
        self.excluded.add(worker_id)
        was_kept = self.kept.get(send.role) == worker_id
        if was_kept:
            del self.kept[send.role]
        if was_kept or isinstance(reply, HalfmoonError):
            self.given_up.append(worker_id)
        return False

    def take_given_up(self) -> list[str]:
        """The workers given up since the last call."""
        taken, self.given_up = self.given_up, []
        self.num_given_up += len(taken)
        return taken

    def is_complete(self, plan: Plan) -> bool:
        if plan.path == "local":
            return "decode" in self.kept
        return "prefill" in self.kept and "decode" in self.kept


# KV a decode worker takes up front for each choice's output: a block's worth (the
# default block size); the rest is taken as the choices grow, preempting when short.
GROWTH_HEADROOM_TOKENS = 16


def num_kv_tokens(request: GenerateRequest) -> int:
    """The tokens decode takes KV for when it accepts the request: the prompt (once,
    whatever `n`) and each choice's first block of output."""
    output = min(request.sampling.max_tokens, GROWTH_HEADROOM_TOKENS)
    return len(request.prompt_token_ids) + request.sampling.n * output


def local_candidates(request: GenerateRequest, decode: Sequence[WorkerHeartbeat]
                     ) -> list[WorkerHeartbeat]:
    """Decode workers that prefill a prompt this short themselves."""
    num_prompt_tokens = len(request.prompt_token_ids)
    return [w for w in decode if num_prompt_tokens <= w.local_prefill_max_tokens]


def plan(request: GenerateRequest, view: ClusterView, progress: Progress, rules: Rules, *,
         prefix: PrefixView | None, turn: int) -> Plan:
    """The next attempt; raises `WorkerUnavailable` or `CapacityExhausted` when none is
    possible."""
    progress.num_attempts += 1
    candidates = local_candidates(request, view.decode)
    if candidates:
        return _plan_local(request, candidates, view, progress)
    return _plan_paired(request, view, progress, rules, prefix, turn)


def _plan_local(request: GenerateRequest, candidates: Sequence[WorkerHeartbeat],
                view: ClusterView, progress: Progress) -> Plan:
    num_tokens = num_kv_tokens(request)
    worker = pick_decode(candidates, progress.excluded, view.pending, num_tokens,
                         request.priority)
    reservation = DecodeReservation(request=request, prefill_worker_id=worker.worker_id,
                                    is_local_prefill=True, delivery=progress.delivery)
    send = Send("decode", worker, reservation, num_tokens=num_tokens)
    return Plan("local", worker, worker, None, (send,))


def _plan_paired(request: GenerateRequest, view: ClusterView, progress: Progress,
                 rules: Rules, prefix: PrefixView | None, turn: int) -> Plan:
    num_tokens = num_kv_tokens(request)
    decode = view.known(progress.kept.get("decode"))
    if decode is None:  # not chosen yet, or its heartbeats vanished: choose (again)
        progress.kept.pop("decode", None)
        decode = pick_decode(view.decode, progress.excluded, view.pending, num_tokens,
                             request.priority)
    prefill = view.known(progress.kept.get("prefill"))
    is_new_prefill = prefill is None
    if prefill is None:
        progress.kept.pop("prefill", None)
        prefill = pick_prefill(view.prefill, progress.excluded, view.pending,
                               policy=rules.policy, prefix=prefix, turn=turn,
                               seed=_seed_inputs(request, decode, rules))
    source = _prefix_source(prefill, view, progress, prefix, rules)
    sends = []
    if is_new_prefill:
        task = PrefillTask(request=request, prefix_source=source, delivery=progress.delivery)
        sends.append(Send("prefill", prefill, task,
                          num_prefill_tokens=uncached_tokens(request, prefill, prefix, source)))
    if is_new_prefill or "decode" not in progress.kept:
        reservation = DecodeReservation(request=request, prefill_worker_id=prefill.worker_id,
                                        delivery=progress.delivery)
        sends.append(Send("decode", decode, reservation, num_tokens=num_tokens))
    return Plan("disaggregated", prefill, decode, source, tuple(sends))


def _seed_inputs(request: GenerateRequest, decode: WorkerHeartbeat, rules: Rules
                 ) -> SeedInputs:
    return SeedInputs(num_prompt_tokens=len(request.prompt_token_ids),
                      block_size=decode.block_size, decode_zone=decode.zone,
                      default_tokens_per_s=rules.default_prefill_tokens_per_s,
                      priority=request.priority)


def _prefix_source(prefill: WorkerHeartbeat, view: ClusterView, progress: Progress,
                   prefix: PrefixView | None, rules: Rules) -> PrefixSource | None:
    if prefix is None or not rules.is_prefix_fetch:
        return None
    holders = [w for w in view.prefill if w.worker_id not in progress.excluded]
    return prefix_source(prefill, holders, prefix, rules.transfer_cost,
                         rules.default_prefill_tokens_per_s)


def uncached_tokens(request: GenerateRequest, prefill: WorkerHeartbeat,
                    prefix: PrefixView | None, source: PrefixSource | None) -> int:
    """Prompt tokens `prefill` will compute: all but its cached (or fetched) prefix."""
    cached = prefix.cached_blocks.get(prefill.worker_id, 0) if prefix else 0
    if source is not None:
        cached = max(cached, source.num_blocks)
    return max(1, len(request.prompt_token_ids) - cached * prefill.block_size)


def admit(request: GenerateRequest, chosen: Plan, pending: Mapping[str, PendingWork],
          prefix: PrefixView | None, rules: Rules) -> None:
    """SLO admission on the chosen pair; raises `SloViolation`. Local placements and
    clusters without an SLO always pass."""
    if chosen.path == "local" or (rules.slo.ttft_s is None and rules.slo.tbt_s is None):
        return
    prefill, source = chosen.prefill, chosen.source
    transfer_s = 0.0
    if source is not None:
        cached = prefix.cached_blocks.get(prefill.worker_id, 0) if prefix else 0
        transfer_s = rules.transfer_cost.seconds(
            (source.num_blocks - cached) * prefill.kv_bytes_per_block)
    queued = pending.get(prefill.worker_id, PendingWork()).num_prefill_tokens
    ttft_s = predicted_ttft_s(prefill, uncached_tokens(request, prefill, prefix, source) + queued,
                              rules.default_prefill_tokens_per_s, transfer_s,
                              priority=request.priority)
    # An idle worker takes the request whatever an estimate that nothing will correct: a
    # prefill worker's that no prefill measured (the default rate) or that no prefill
    # renewed for `STALE_FIT_S`, a decode worker's step (alone, the request gets the
    # fastest steps that worker has). Running it measures the worker. (Otherwise such an
    # estimate refused every request for good.)
    if _is_idle(prefill, pending) and (
            prefill.prefill_fit_age_s > STALE_FIT_S
            or not (prefill.prefill_s_per_token or prefill.prefill_tokens_per_s)):
        ttft_s = 0.0
    decode = chosen.decode
    check_slo(ttft_s, 0.0 if _is_idle(decode, pending) else predicted_tbt_s(decode), rules.slo)


def _is_idle(worker: WorkerHeartbeat, pending: Mapping[str, PendingWork]) -> bool:
    """Nothing running, waiting or on its way there."""
    return (worker.num_running == 0 and worker.num_waiting == 0
            and pending.get(worker.worker_id, PendingWork()).num_requests == 0)


def with_sent(pending: PendingWork | None, send: Send) -> PendingWork:
    """A worker's pending work once `send` is sent to it."""
    entry = pending or PendingWork()
    return PendingWork(entry.num_requests + 1, entry.num_blocks + _num_blocks(send),
                       entry.num_prefill_tokens + send.num_prefill_tokens)


def without_sent(pending: PendingWork, send: Send) -> PendingWork | None:
    """A worker's pending work once it refused `send`; None when none is left. (Never
    below zero: a heartbeat may have counted the worker's work afresh since the send.)"""
    entry = PendingWork(max(0, pending.num_requests - 1),
                        max(0, pending.num_blocks - _num_blocks(send)),
                        max(0, pending.num_prefill_tokens - send.num_prefill_tokens))
    return None if entry == PendingWork() else entry


def _num_blocks(send: Send) -> int:
    return blocks_needed(send.num_tokens, send.worker.block_size) if send.num_tokens else 0


def describe(chosen: Plan, prefix: PrefixView | None, num_candidates: int
             ) -> dict[str, str | int]:
    """The decision and its inputs, as span attributes (`halfmoon.*`)."""
    prefill, decode, source = chosen.prefill, chosen.decode, chosen.source
    return {
        "halfmoon.path": chosen.path,
        "halfmoon.prefill_worker": prefill.worker_id,
        "halfmoon.decode_worker": decode.worker_id,
        "halfmoon.prompt_blocks": prefix.num_blocks if prefix else 0,
        "halfmoon.cached_blocks": prefix.cached_blocks.get(prefill.worker_id, 0)
        if prefix else 0,
        "halfmoon.prefix_source": source.worker_id if source else "",
        "halfmoon.prefill_load": prefill.num_running + prefill.num_waiting,
        "halfmoon.prefill_waiting_tokens": prefill.num_waiting_tokens,
        "halfmoon.decode_free_blocks": decode.num_free_blocks,
        "halfmoon.num_prefill_candidates": num_candidates,
    }
