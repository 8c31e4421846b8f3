"""Accelerator utilization per worker, read from the workers' heartbeats on NATS.

Every heartbeat carries `busy_s`, the wall seconds the worker's device has spent in model
steps since it started. Between two snapshots a worker's utilization is the growth of its
`busy_s` over the growth of its `sent_at_s`: a custom NATS subscriber needs nothing else.
The probe also counts the public `migrated` request events (requests placed again after a
lost worker, or shed by a crowded decode worker).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec
import nats

from shared.messages import WorkerHeartbeat
from shared.nats_client import subscribed
from shared.subjects import Subjects


@dataclass(frozen=True)
class WorkerUtilization:
    worker_id: str
    role: str
    utilization: float  # busy / wall, 0..1


class UtilizationProbe:
    """Keeps each worker's latest heartbeat; `snapshot()` then `since(snapshot)`."""

    def __init__(self, nats_url: str, cluster: str = "default") -> None:
        self.nats_url = nats_url
        self.subjects = Subjects(cluster)
        self.latest: dict[str, WorkerHeartbeat] = {}
        # (monotonic seconds, worker id, role) each time a worker is first heard in a role:
        # the split over time, role changes included.
        self.roles: list[tuple[float, str, str]] = []  # (at, worker, role) at each change
        self.models: list[tuple[float, str, str]] = []  # (at, worker, model) alike
        self.num_migrated = 0  # `migrated` request events heard
        self._nc: nats.NATS | None = None
        self._decoder = msgspec.json.Decoder(WorkerHeartbeat)
        self._num_expected = 0
        self._has_all = asyncio.Event()

    async def start(self) -> None:
        self._nc = await nats.connect(self.nats_url)
        await self._nc.subscribe(self.subjects.all_heartbeats, cb=self._on_heartbeat)
        await self._nc.subscribe(self.subjects.request_event("migrated"), cb=self._on_migrated)
        await subscribed(self._nc)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.drain()
            self._nc = None

    async def _on_migrated(self, message: nats.aio.msg.Msg) -> None:
        self.num_migrated += 1

    async def _on_heartbeat(self, message: nats.aio.msg.Msg) -> None:
        try:
            heartbeat = self._decoder.decode(message.data)
        except msgspec.DecodeError:
            return
        before = self.latest.get(heartbeat.worker_id)
        if before is None or (before.role, before.model) != (heartbeat.role, heartbeat.model):
            self.roles.append((time.monotonic(), heartbeat.worker_id, heartbeat.role))
            self.models.append((time.monotonic(), heartbeat.worker_id, heartbeat.model))
        self.latest[heartbeat.worker_id] = heartbeat
        if len(self.latest) >= self._num_expected:
            self._has_all.set()

    async def wait_for_workers(self, num_workers: int, timeout_s: float = 30.0) -> None:
        """Until heartbeats from `num_workers` workers have come."""
        self._num_expected = num_workers
        if len(self.latest) >= num_workers:
            return
        self._has_all.clear()
        await asyncio.wait_for(self._has_all.wait(), timeout_s)

    def snapshot(self) -> dict[str, WorkerHeartbeat]:
        return dict(self.latest)

    async def since(self, start: dict[str, WorkerHeartbeat], settle_s: float = 1.2
                    ) -> list[WorkerUtilization]:
        """Each worker's utilization from `start` to its next-but-latest heartbeat (waits
        `settle_s` for the heartbeats that cover the end of the run)."""
        await asyncio.sleep(settle_s)
        result = []
        for worker_id, end in sorted(self.latest.items()):
            begin = start.get(worker_id)
            if begin is None or end.sent_at_s <= begin.sent_at_s:
                continue
            busy = (end.busy_s - begin.busy_s) / (end.sent_at_s - begin.sent_at_s)
            result.append(WorkerUtilization(worker_id, end.role, min(1.0, max(0.0, busy))))
        return result
