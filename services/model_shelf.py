"""The models a worker can serve, and its switches between them.

A worker serves one model at a time, loaded; it may hold more on local disk (`--models-dir`:
one Hugging Face directory per model, named by the model) or, on the sim engine, simulate
any profile. A `RoleChange` naming another model on its shelf reloads the worker: it takes
no new work, finishes what it holds, then closes its engine (weights and KV pool) and its
connections and starts again with the new model under the same worker id: a new
`WorkerService` in the same process (`WorkerRunner`). Its heartbeats list the shelf
(`models_on_disk`) and how long its model took to load (`model_load_s`), which the
conductor's placement and planner read.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from shared.config import WorkerConfig
from shared.errors import ConfigError
from shared.messages import WorkerRole
from shared.service import Service


def models_on_disk(config: WorkerConfig) -> list[str]:
    """Every model this worker could switch to, its own included, in name order."""
    names = {config.model}
    if config.engine.kind == "sim":
        from engine.sim_cost import PROFILES

        names |= set(PROFILES)
    if config.models_dir is not None:
        root = Path(config.models_dir).expanduser()
        if root.is_dir():
            names |= {p.name for p in root.iterdir()
                      if (p / "config.json").exists() or config.engine.kind != "torch"}
    return sorted(names)


def config_for_model(config: WorkerConfig, worker_id: str, model: str, role: WorkerRole
                     ) -> WorkerConfig:
    """This worker's config serving `model` as `role`; ConfigError when it cannot."""
    if model not in models_on_disk(config):
        raise ConfigError(f"the model `{model}` is not on this worker's disk "
                          f"(--models-dir {config.models_dir or 'unset'})")
    engine = config.engine
    model_dir = Path(config.models_dir).expanduser() / model if config.models_dir else None
    if model_dir is not None and model_dir.is_dir():
        engine = msgspec.structs.replace(engine, model_path=str(model_dir))
    return msgspec.structs.replace(config, model=model, role=role, worker_id=worker_id,
                                   engine=engine)


class WorkerRunner:
    """A worker, and its successors each time it stops to reload as another model; `stop()`
    stops whichever runs now, and the run ends there."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self._is_stopped = False

    async def run(self) -> None:
        from services.worker import WorkerService

        await self.service.run()
        while (not self._is_stopped and isinstance(self.service, WorkerService)
               and self.service.reload_as is not None):
            self.service = WorkerService(self.service.reload_as)
            await self.service.run()

    def stop(self) -> None:
        self._is_stopped = True
        self.service.request_stop()
