"""Which worker loads a model no healthy worker of a role serves, and the loads in flight."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from services.conductor.assignment import ClusterView
from services.conductor.model_loader import ModelLoader
from services.conductor.model_loads import UNMEASURED_LOAD_S, ModelLoads, pick_loader
from shared.config import ConductorConfig
from shared.heartbeats import WorkerDirectory
from shared.messages import DispatchReply, RoleChange, WorkerHeartbeat, WorkerRole
from shared.subjects import Subjects
from tests.unit.test_assignment import REQUEST

SHELF = ["a", "b"]


def worker(worker_id: str, model: str, role: WorkerRole, **changes: Any) -> WorkerHeartbeat:
    fields: dict[str, Any] = {
        "worker_id": worker_id, "role": role, "model": model, "host": "h", "num_running": 0,
        "num_waiting": 0, "max_batch_size": 8, "num_free_blocks": 10, "num_total_blocks": 10,
        "block_size": 16, "heartbeat_interval_s": 0.5, "sent_at_s": 0.0,
        "prefill_s_per_token": 0.001, "models_on_disk": SHELF, "model_load_s": 2.0, **changes}
    return WorkerHeartbeat(**fields)


def test_the_loader_is_the_one_that_serves_soonest() -> None:
    workers = [worker("a-d1", "a", "decode", model_load_s=8.0), worker("a-d2", "a", "decode"),
               worker("a-d3", "a", "decode", num_waiting_tokens=20_000)]  # 20 s queued
    assert pick_loader("b", "decode", workers, 100, 2000.0).worker_id == "a-d2"


def test_a_model_is_never_left_without_a_worker_of_a_role() -> None:
    workers = [worker("a-p", "a", "prefill"), worker("a-d", "a", "decode")]
    assert pick_loader("b", "decode", workers, 100, 2000.0) is None


def test_only_a_worker_with_the_model_on_its_disk_loads_it() -> None:
    workers = [worker("a-d1", "a", "decode", models_on_disk=["a"]),
               worker("a-d2", "a", "decode", models_on_disk=["a"])]
    assert pick_loader("b", "decode", workers, 100, 2000.0) is None


def test_an_unmeasured_load_time_counts_as_long() -> None:
    workers = [worker("a-d1", "a", "decode", model_load_s=0.0),
               worker("a-d2", "a", "decode", model_load_s=UNMEASURED_LOAD_S - 1)]
    assert pick_loader("b", "decode", workers, 100, 2000.0).worker_id == "a-d2"


def test_a_load_is_in_flight_until_its_worker_serves_the_model_or_it_overstays() -> None:
    loads = ModelLoads(margin_s=10.0)
    loader = worker("a-d1", "a", "decode")
    loads.start("b", "decode", loader, now_s=100.0)
    assert loads.in_flight("b", "decode", now_s=101.0).worker_id == "a-d1"
    loads.observe(worker("a-d1", "a", "decode"))  # still reloading: not done
    assert loads.in_flight("b", "decode", now_s=101.0) is not None
    loads.observe(worker("a-d1", "b", "decode"))
    assert loads.in_flight("b", "decode", now_s=101.0) is None
    loads.start("b", "decode", loader, now_s=100.0)
    assert loads.in_flight("b", "decode", now_s=113.9) is not None  # 2 x 2 s + 10 s margin
    assert loads.in_flight("b", "decode", now_s=114.1) is None


def test_a_load_another_conductor_asked_for_is_in_flight_here_too() -> None:
    loads = ModelLoads()
    loading = worker("a-d1", "a", "decode", is_draining=True, loading_model="b",
                     loading_role="decode", model_load_s=4.0)
    loads.observe(loading, now_s=100.0)
    load = loads.in_flight("b", "decode", now_s=101.0)
    assert load is not None and (load.worker_id, load.load_s) == ("a-d1", 4.0)
    assert loads.in_flight("b", "prefill", now_s=101.0) is None
    loads.observe(worker("a-d1", "b", "decode"), now_s=106.0)  # loaded: it serves b now
    assert loads.in_flight("b", "decode", now_s=106.0) is None


async def test_a_held_request_asks_one_worker_to_load_its_model_once() -> None:
    asked: list[tuple[str, RoleChange]] = []

    async def dispatch(subject: str, change: RoleChange) -> DispatchReply:
        asked.append((subject, change))
        return DispatchReply(is_accepted=True, worker_id="a-d2")

    tasks: list[asyncio.Task[None]] = []
    workers = WorkerDirectory(timeout_s=5.0)
    for heartbeat in (worker("a-p", "a", "prefill"), worker("a-d1", "a", "decode"),
                      worker("a-d2", "a", "decode", model_load_s=1.0)):
        workers.observe(heartbeat)
    loader = ModelLoader(Subjects("t"), workers, ConductorConfig(), "conductor", dispatch,
                         lambda coro, name: tasks.append(asyncio.create_task(coro)))
    request = msgspec.structs.replace(REQUEST, model="b")
    view = ClusterView(prefill=[], decode=[], pending={}, known=workers.get)
    first, second = loader.hold(request, view), loader.hold(request, view)
    await asyncio.gather(*tasks)
    assert first is not None and second is not None and first.load_s == 1.0
    assert "a-d2 is loading it" in first.message
    assert [(s, c.model, c.role) for s, c in asked] == [
        (Subjects("t").role_change("a-d2"), "b", "decode")]
