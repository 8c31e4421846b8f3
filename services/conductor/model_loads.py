"""Loading a model that no healthy worker of a role serves (scale from zero): which worker
loads it, and the loads in flight. Pure, tested without NATS.

A request for such a model, when a worker of another model holds its files on disk
(`models_on_disk`), is held as for a restarting worker while that worker is told to load it
(`RoleChange.model`: it finishes its own work first). The loader is the candidate of least
seed cost (`cost_model`): the predicted TTFT with its measured load time added, stretched by
its score, whose "model" term is 0 for all of them (none has the model loaded). Only a worker
whose own model keeps another healthy worker of its role is asked, so a load never leaves a
model without a role. One load per (model, role) at a time: a loader heartbeats what it is
loading, so another conductor's load (or the planner's move) counts as in flight here too.
The request is held for the loader's load time on top of the usual hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from services.conductor.cost_model import predicted_ttft_s, seed_score
from shared.messages import WorkerHeartbeat, WorkerRole

# A worker that never loaded a model counts this long (its heartbeat says 0: unmeasured).
UNMEASURED_LOAD_S = 30.0


def load_time_s(worker: WorkerHeartbeat) -> float:
    return worker.model_load_s or UNMEASURED_LOAD_S


def loader_cost(worker: WorkerHeartbeat, num_prompt_tokens: int,
                default_tokens_per_s: float) -> float:
    ttft = predicted_ttft_s(worker, num_prompt_tokens, default_tokens_per_s,
                            load_s=load_time_s(worker))
    load = (worker.num_running + worker.num_waiting) / max(1, worker.max_batch_size)
    score = seed_score(worker, load=load, max_queue=worker.max_queue or 4 * worker.max_batch_size,
                       fastest=1.0, decode_zone=worker.zone, is_model_loaded=False)
    return ttft * (2.0 - score)


def pick_loader(model: str, role: WorkerRole, healthy: Sequence[WorkerHeartbeat],
                num_prompt_tokens: int, default_tokens_per_s: float) -> WorkerHeartbeat | None:
    """The worker of another model that should load `model` to serve as `role`, or None."""
    def others_of_its_role(worker: WorkerHeartbeat) -> int:
        return sum(1 for w in healthy if w.model == worker.model and w.role == worker.role
                   and w.worker_id != worker.worker_id)

    able = [w for w in healthy if w.model != model and model in w.models_on_disk
            and others_of_its_role(w) > 0]
    if not able:
        return None
    return min(able, key=lambda w: (loader_cost(w, num_prompt_tokens, default_tokens_per_s),
                                    w.worker_id))


@dataclass(frozen=True)
class ModelLoad:
    worker_id: str
    load_s: float  # the loader's expected load time
    started_s: float  # monotonic


class ModelLoads:
    """Loads this conductor asked for, by (model, role), until the loader heartbeats the
    model or twice its expected load time (plus a margin) passed."""

    def __init__(self, margin_s: float = 10.0) -> None:
        self.margin_s = margin_s
        self._loads: dict[tuple[str, WorkerRole], ModelLoad] = {}

    def in_flight(self, model: str, role: WorkerRole, now_s: float | None = None
                  ) -> ModelLoad | None:
        now_s = time.monotonic() if now_s is None else now_s
        load = self._loads.get((model, role))
        if load is not None and now_s - load.started_s > 2 * load.load_s + self.margin_s:
            del self._loads[(model, role)]
            return None
        return load

    def start(self, model: str, role: WorkerRole, worker: WorkerHeartbeat,
              now_s: float | None = None) -> ModelLoad:
        now_s = time.monotonic() if now_s is None else now_s
        load = ModelLoad(worker.worker_id, load_time_s(worker), now_s)
        self._loads[(model, role)] = load
        return load

    def observe(self, heartbeat: WorkerHeartbeat, now_s: float | None = None) -> None:
        """A worker heartbeats: a load it was asked for is done once it serves the model;
        one it says it is loading (asked by another conductor, or the planner) is in flight
        here too, so no second worker is taken for it."""
        load = self._loads.get((heartbeat.model, heartbeat.role))
        if load is not None and load.worker_id == heartbeat.worker_id:
            del self._loads[(heartbeat.model, heartbeat.role)]
        if heartbeat.loading_model and heartbeat.loading_role is not None \
                and self.in_flight(heartbeat.loading_model, heartbeat.loading_role, now_s) is None:
            self.start(heartbeat.loading_model, heartbeat.loading_role, heartbeat, now_s)
