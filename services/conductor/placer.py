"""The conductor's one placement loop, for both paths: a prefill and a decode worker, or one
decode worker that prefills the request itself.

Each attempt takes the live workers of the request's model, asks `assignment` for a plan
(admitted against the SLOs and KV room on the first attempt), sends the plan's commands at
once and records the replies in `assignment.Progress`: a side that accepted is kept, one
that refused is placed again (up to `max_placement_attempts`), one given up is told to drop
the request. What was sent since a worker's last heartbeat counts as its pending work from
the moment it is sent (taken back if refused), so requests placed between two heartbeats,
or at once, do not pile onto one worker. The decisions are pure (`assignment`,
`placement`); this module sends and receives.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from services.conductor import assignment
from services.conductor.assignment import Plan
from services.conductor.model_loader import ModelLoader
from services.conductor.placement import PendingWork, PrefixView, prefix_view
from services.conductor.prefix_index import PrefixIndex
from shared import tracing
from shared.config import ConductorConfig
from shared.errors import (
    ErrorCode,
    HalfmoonError,
    NoHealthyWorker,
    RequestAborted,
    Shortage,
    WorkerUnavailable,
)
from shared.heartbeats import WorkerDirectory
from shared.logs import get_logger
from shared.messages import DispatchReply, GenerateRequest, PrefillTask, WorkerHeartbeat
from shared.metrics import ConductorMetrics
from shared.subjects import Subjects

log = get_logger(__name__)

# Sends a command to one worker: its reply, or why none came.
Dispatch = Callable[[str, Any, dict[str, str]], Awaitable[DispatchReply | HalfmoonError]]


class Abort(Protocol):
    """Tells one worker to drop a request (what it took from `before_delivery` of
    `attempt` on is not its to drop: see `services/superseded.py`)."""

    def __call__(self, request_id: str, reason: str, worker_id: str = "", *,
                 attempt: int = 0, before_delivery: int = 0) -> Awaitable[None]: ...


class Lapsed(Exception):
    """The request is no longer this conductor's to place (its delivery lapsed)."""


class Placer:
    """Places requests on the workers in `workers`; `dispatch` and `abort` reach them."""

    def __init__(self, config: ConductorConfig, subjects: Subjects, workers: WorkerDirectory,
                 prefix_index: PrefixIndex, model_loader: ModelLoader,
                 metrics: ConductorMetrics, dispatch: Dispatch, abort: Abort) -> None:
        self.config = config
        self.subjects = subjects
        self.workers = workers
        self.prefix_index = prefix_index
        self.model_loader = model_loader
        self.metrics = metrics
        self.dispatch = dispatch
        self.abort = abort
        self.rules = assignment.Rules.from_config(config)
        self.pending: dict[str, PendingWork] = {}
        self._turn = 0

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        """A heartbeat counts what was pending on its worker."""
        self.pending.pop(heartbeat.worker_id, None)

    async def place(self, request: GenerateRequest,
                    progress: assignment.Progress | None = None, *,
                    is_current: Callable[[], bool] = lambda: True) -> Plan:
        """Place the request: each attempt's commands sent at once, accepted sides kept
        (`progress` may hold some already); none sent once `is_current` says the request is
        no longer this conductor's (raises `Lapsed`). Raises the `HalfmoonError` that made
        placement impossible: `RequestAborted` at once when a worker refused it as ended by
        its gateway (it heard the abort before this conductor did)."""
        progress = progress or assignment.Progress()
        prefix = self.prefix_view(request)
        error: HalfmoonError = WorkerUnavailable("no placement attempted")
        for _ in range(self.config.max_placement_attempts):
            self._turn += 1
            view = self.view(request.model)
            try:
                chosen = assignment.plan(request, view, progress, self.rules,
                                         prefix=prefix, turn=self._turn)
                if progress.num_attempts == 1:
                    assignment.admit(request, chosen, self.pending, prefix, self.rules)
            except NoHealthyWorker as exc:
                # Every worker left refused: a refusal for want of room says more than
                # "none healthy".
                if not isinstance(error, Shortage):
                    error = self.model_loader.hold(request, view) or exc
                break
            except HalfmoonError as exc:
                error = exc
                break
            if not is_current():
                raise Lapsed
            error = await self._send(chosen, progress) or error
            if isinstance(error, RequestAborted):  # no worker will take it: it is gone
                raise error
            if not is_current():  # its replies came late: the sides it would abort may now
                raise Lapsed  # run the next delivery (on the same workers)
            for worker_id in progress.take_given_up():  # what this delivery placed there
                await self.abort(request.request_id, "placed elsewhere", worker_id,
                                 attempt=request.attempt,
                                 before_delivery=progress.delivery + 1 if progress.delivery else 0)
            if progress.is_complete(chosen):
                self._count(chosen, prefix, num_candidates=len(view.prefill))
                return chosen
        raise error

    async def _send(self, chosen: Plan, progress: assignment.Progress) -> HalfmoonError | None:
        """One attempt's commands, at once; the last refusal's error, if any refused."""
        headers = tracing.inject() or {}  # once for both sides: the same context
        for send in chosen.sends:  # counted now: placements in flight meanwhile see it
            worker_id = send.worker.worker_id
            self.pending[worker_id] = assignment.with_sent(self.pending.get(worker_id), send)
        replies = await asyncio.gather(*(
            self.dispatch(self._subject(send), send.message,
                          headers if _makes_span(send) else {})
            for send in chosen.sends))
        error = None
        for send, reply in zip(chosen.sends, replies, strict=True):
            if not progress.record(send, reply):
                worker_id = send.worker.worker_id
                self._take_back(worker_id, send)
                error = _refusal_error(worker_id, reply)
        return error

    def _take_back(self, worker_id: str, send: assignment.Send) -> None:
        """A refused command's work, counted when it was sent (unless a heartbeat has
        counted the worker's work afresh since)."""
        entry = self.pending.get(worker_id)
        if entry is not None:
            if (left := assignment.without_sent(entry, send)) is None:
                del self.pending[worker_id]
            else:
                self.pending[worker_id] = left

    def view(self, model: str) -> assignment.ClusterView:
        """The workers of the request's model only: a request is never placed, and its
        prefix never looked for, on another model's worker (their KV never matches)."""
        return assignment.ClusterView(
            prefill=self.workers.healthy("prefill", model=model),
            decode=self.workers.healthy("decode", model=model),
            pending=self.pending, known=self.workers.get)

    def prefix_view(self, request: GenerateRequest) -> PrefixView | None:
        return prefix_view(request.prompt_token_ids,
                           self.workers.healthy("prefill", model=request.model),
                           self.prefix_index, policy=self.config.policy,
                           is_fetch_enabled=self.config.prefix_fetch)

    def _subject(self, send: assignment.Send) -> str:
        worker_id = send.worker.worker_id
        return self.subjects.prefill_task(worker_id) if send.role == "prefill" \
            else self.subjects.decode_reserve(worker_id)

    def _count(self, chosen: Plan, prefix: PrefixView | None, *, num_candidates: int) -> None:
        """Metrics, and the decision with its inputs on the schedule span."""
        self.metrics.placements.labels(self.config.policy, chosen.path,
                                       "true" if chosen.source else "false").inc()
        span = tracing.recording_span()
        if span is not None:
            span.set_attributes(assignment.describe(chosen, prefix, num_candidates))


def _makes_span(send: assignment.Send) -> bool:
    """Whether the receiver makes a span under the command's trace context: a prefill task
    does, and so does a decode worker prefilling itself; a paired decode reservation's
    span comes later, a child of prefill's (`KvCommitted` carries that context)."""
    return isinstance(send.message, PrefillTask) or send.message.is_local_prefill


def _refusal_error(worker_id: str, reply: DispatchReply | HalfmoonError) -> HalfmoonError:
    reason = reply.message if isinstance(reply, HalfmoonError) else reply.reason
    log.info("placement.refused", worker_id=worker_id, reason=reason)
    if isinstance(reply, DispatchReply) and reply.code == ErrorCode.CAPACITY_EXHAUSTED:
        return Shortage(f"{worker_id} refused: {reason}")  # its blocks or queue will free
    if isinstance(reply, DispatchReply) and reply.code == ErrorCode.ABORTED:
        return RequestAborted(f"{worker_id} refused: {reason}")  # its gateway ended it
    return WorkerUnavailable(f"{worker_id} refused: {reason}")
