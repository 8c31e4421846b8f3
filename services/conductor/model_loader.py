"""Scale from zero at placement: a request whose model no healthy worker of a role serves is
held while a worker with the model on its disk is told to load it (a `RoleChange` naming the
model). Whom to ask, and which loads are in flight, are decided in `model_loads`; this module
sends the ask and traces it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from services.conductor import assignment
from services.conductor.model_loads import ModelLoads, pick_loader
from shared import tracing
from shared.config import ConductorConfig
from shared.errors import HalfmoonError, ModelLoading
from shared.heartbeats import WorkerDirectory
from shared.logs import get_logger
from shared.messages import DispatchReply, GenerateRequest, RoleChange, WorkerHeartbeat, WorkerRole
from shared.subjects import Subjects

log = get_logger(__name__)

Dispatch = Callable[[str, RoleChange], Awaitable[DispatchReply | HalfmoonError]]


class ModelLoader:
    """Asks for the loads a held request needs; `dispatch` sends a command to one worker
    and returns its reply or why none came."""

    def __init__(self, subjects: Subjects, workers: WorkerDirectory, config: ConductorConfig,
                 requested_by: str, dispatch: Dispatch,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], Any]) -> None:
        self.dispatch = dispatch
        self.subjects = subjects
        self.workers = workers
        self.config = config
        self.requested_by = requested_by
        self.spawn = spawn
        self.loads = ModelLoads()

    def observe(self, heartbeat: WorkerHeartbeat) -> None:
        self.loads.observe(heartbeat)

    def hold(self, request: GenerateRequest, view: assignment.ClusterView
             ) -> ModelLoading | None:
        """The error to hold `request` with while its model loads (a load is asked for
        here unless one is in flight), or None when no worker can load it."""
        role: WorkerRole = "decode" if not view.decode else "prefill"
        if role == "prefill" and assignment.local_candidates(request, view.decode):
            return None
        model = request.model
        load = self.loads.in_flight(model, role)
        if load is None:
            everyone = [*self.workers.healthy("prefill"), *self.workers.healthy("decode")]
            loader = pick_loader(model, role, everyone, len(request.prompt_token_ids),
                                 self.config.default_prefill_tokens_per_s)
            if loader is None:
                return None
            load = self.loads.start(model, role, loader)
            self.spawn(self._ask(loader, model, role), f"load.{loader.worker_id}")
        return ModelLoading(f"no healthy {role} worker serves {model}; {load.worker_id} is "
                            f"loading it (about {load.load_s:.0f} s)", role=role,
                            load_s=load.load_s)

    async def _ask(self, loader: WorkerHeartbeat, model: str, role: WorkerRole) -> None:
        reason = f"no healthy {role} worker serves {model}"
        log.info("model.load_requested", worker=loader.worker_id, model=model, role=role,
                 from_model=loader.model, load_s=loader.model_load_s)
        with tracing.span(__name__, "conductor.model_load", attributes={
                "halfmoon.worker": loader.worker_id, "halfmoon.model": model,
                "halfmoon.role": role, "halfmoon.from_model": loader.model}):
            reply = await self.dispatch(self.subjects.role_change(loader.worker_id),
                                        RoleChange(role=role, model=model, reason=reason,
                                                   requested_by=self.requested_by))
        if isinstance(reply, HalfmoonError) or not reply.is_accepted:
            refusal = reply.message if isinstance(reply, HalfmoonError) else reply.reason
            log.warning("model.load_refused", worker=loader.worker_id, model=model,
                        reason=refusal)
