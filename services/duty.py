"""A worker's duty: the work of its role (prefill or decode), inside a `WorkerService` that
owns what both roles share: the engine (weights, KV pool, prefix cache), the transfer
engine, the KV leases, heartbeats and the registry entry.

Lifecycle of a duty:
    start()        subscribe to the role's subjects and start its loops.
    stop_intake()  refuse new work; the subscriptions stay, so what is held still completes
                   (a prefill still hears its KV target, a decode worker its commits).
    is_idle()      nothing is held any more.
    resume()       take work again (the worker switched back before this finished).
    stop()         unsubscribe and cancel the role's loops; called once idle.
    close()        at shutdown, after the drain: fail whatever is still held, loudly.
A role change is the new duty's start() (or resume()) and the old one's stop_intake, then,
once it is idle, its stop(): for a while one worker serves the new role and finishes the
old. A shutdown is stop_intake -> is_idle (bounded) -> close.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar

from services.kv_handoff import KvHandoff
from services.superseded import Mark
from shared.errors import ErrorCode
from shared.heartbeats import WorkerDirectory
from shared.messages import DispatchReply, GenerateRequest, Message, WorkerRole

if TYPE_CHECKING:
    from services.worker import WorkerService

# (subject, message type, handler) of one of a role's subscriptions (`Service.serve`).
Handler = tuple[str, Any, Callable[[Any], Awaitable[Message | None]]]


class Duty(abc.ABC):
    """One role's work in a worker. Built once the worker's parts are assembled: the parts
    a role uses are read from the worker here, once."""

    role: ClassVar[WorkerRole]

    def __init__(self, worker: WorkerService) -> None:
        self.worker = worker
        self.engine = worker.engine
        self.nc = worker.nc
        self.subjects = worker.subjects
        self.config = worker.config
        self.metrics = worker.metrics
        self.leases = worker.leases
        self.worker_id = worker.worker_id
        self.log = worker.log
        self.is_draining = False
        self._subscriptions: list[Any] = []
        self._loops: list[asyncio.Task[Any]] = []

    @property
    def handoff(self) -> KvHandoff:
        return self.worker.handoff  # read each time: a test may wrap it in a fault

    async def start(self) -> None:
        self._subscriptions = [await self.worker.serve(subject, message_type, handler)
                               for subject, message_type, handler in self._handlers()]

    def stop_intake(self) -> None:
        self.is_draining = True

    def resume(self) -> None:
        self.is_draining = False

    async def stop(self) -> None:
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._subscriptions = []
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        self._loops = []

    def refusal_if_stale(self, request: GenerateRequest, delivery: int) -> DispatchReply | None:
        """The refusal of a placement's command (a task, a reservation) that comes after its
        request was placed again from a later delivery, or ended (`Superseded`)."""
        if (superseded := self.worker.superseded.refusal(request, delivery)) is not None:
            return self.worker.refusal(superseded)
        return self.refusal_if_ended(request.request_id)

    def refusal_if_ended(self, request_id: str) -> DispatchReply | None:
        """The refusal of a command for a request its gateway has ended (`Superseded`),
        coded `aborted`: its sender lets the request go rather than recover it."""
        if not self.worker.superseded.is_ended(request_id):
            return None
        return self.worker.refusal(f"request {request_id} was ended by its gateway",
                                   code=ErrorCode.ABORTED)

    def run_loop(self, coro: Any, name: str) -> None:
        """A loop of this role (the decode steps): owned by the worker, ended by stop()."""
        self._loops.append(self.worker.spawn(coro, name))

    @abc.abstractmethod
    def _handlers(self) -> list[Handler]:
        """This role's subjects, each with its message type and handler."""

    @abc.abstractmethod
    def is_idle(self) -> bool:
        """Nothing of this role is held: no request queued, computing or streaming."""

    @abc.abstractmethod
    def abort(self, request_id: str, *, placed_from: Mark | None = None) -> None:
        """Drop the request wherever it is and free its blocks. `placed_from`: the abort
        places it again from there, and what already belongs to that placement here (a KV
        target that came before the abort) is kept."""

    def on_tick(self) -> None:
        """Called on every heartbeat: expire stale per-request state."""

    def num_waiting(self) -> int:
        return self.engine.stats().num_waiting

    def worker_views(self) -> list[WorkerDirectory]:
        """The worker directories this role judges by heartbeats."""
        return []

    async def close(self) -> None:
        """At shutdown, after the drain: fail what is still held."""
