"""The placement loop's bookkeeping across concurrent placements, against workers that
answer through a fake `Dispatch` (our own protocol, no NATS)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import msgspec

from services.conductor.model_loader import ModelLoader
from services.conductor.placer import Placer
from services.conductor.prefix_index import PrefixIndex
from shared.config import ConductorConfig
from shared.errors import HalfmoonError
from shared.heartbeats import WorkerDirectory
from shared.messages import DispatchReply, GenerateRequest, SamplingParams
from shared.metrics import ConductorMetrics
from shared.subjects import Subjects
from tests.unit.test_placement import worker


class Workers:
    """Workers that hold every reply until `answer` lets them go; `refusing` refuse."""

    def __init__(self, refusing: frozenset[str] = frozenset()) -> None:
        self.refusing = refusing
        self.gate = asyncio.Event()
        self.sent: Counter[str] = Counter()

    async def dispatch(self, subject: str, message: Any, headers: dict[str, str]
                       ) -> DispatchReply | HalfmoonError:
        worker_id = subject.split(".")[-2]  # halfmoon.<cluster>.v1.worker.<id>.<verb>
        self.sent[worker_id] += 1
        await self.gate.wait()
        return DispatchReply(is_accepted=worker_id not in self.refusing, worker_id=worker_id,
                             reason="full" if worker_id in self.refusing else "")

    async def abort(self, request_id: str, reason: str, worker_id: str = "", *,
                    attempt: int = 0, before_delivery: int = 0) -> None:
        pass


def placer(workers: Workers) -> Placer:
    config = ConductorConfig(policy="least-loaded")
    directory = WorkerDirectory(timeout_s=60)
    for heartbeat in (worker("p1"), worker("d1", "decode", free=1000),
                      worker("d2", "decode", free=1000)):
        directory.observe(msgspec.structs.replace(heartbeat, model="m", max_batch_size=64))
    subjects = Subjects("test")
    return Placer(config, subjects, directory, PrefixIndex(),
                  ModelLoader(subjects, directory, config, "c", workers.dispatch,
                              lambda coro, name: asyncio.ensure_future(coro)),
                  ConductorMetrics(), workers.dispatch, workers.abort)


def request(i: int) -> GenerateRequest:
    return GenerateRequest(request_id=f"r{i}", model="m", prompt_token_ids=list(range(40)),
                           sampling=SamplingParams(max_tokens=8), reply_subject="x",
                           created_at_s=0.0)


async def test_requests_placed_at_once_count_each_other_before_any_reply() -> None:
    """Placements in flight together (the conductor's fetchers, its line): each counts
    what the others sent, not only what was accepted, so a burst between two heartbeats
    spreads over equal decode workers instead of piling onto the first."""
    workers = Workers()
    placing = placer(workers)
    tasks = [asyncio.create_task(placing.place(request(i))) for i in range(8)]
    await asyncio.sleep(0.01)  # every command sent, none answered
    workers.gate.set()
    plans = await asyncio.gather(*tasks)
    assert Counter(plan.decode.worker_id for plan in plans) == {"d1": 4, "d2": 4}
    assert placing.pending["d1"].num_requests == placing.pending["d2"].num_requests == 4


async def test_a_refused_command_is_not_left_as_pending_work() -> None:
    workers = Workers(refusing=frozenset({"d1"}))
    placing = placer(workers)
    workers.gate.set()
    plan = await placing.place(request(0))
    assert plan.decode.worker_id == "d2"
    assert "d1" not in placing.pending
    assert placing.pending["d2"].num_requests == 1
