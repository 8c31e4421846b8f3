"""A worker's early heartbeats on a real nats-server: coalesced, `EARLY_GAP_S` apart."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import nats
from nats.aio.msg import Msg

from services.heartbeat_sender import EARLY_GAP_S, HeartbeatSender
from shared.messages import WorkerHeartbeat
from shared.nats_client import subscribed
from shared.subjects import Subjects
from tests.stack import eventually


def heartbeat() -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id="w1", role="prefill", model="m", host="h", num_running=0, num_waiting=0,
        max_batch_size=8, num_free_blocks=10, num_total_blocks=10, block_size=16,
        heartbeat_interval_s=0.5, sent_at_s=0.0)


async def test_early_heartbeats_coalesce_and_keep_their_gap(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")
    beats: list[float] = []

    async def on_beat(_msg: Msg) -> None:
        beats.append(time.monotonic())

    tasks: list[asyncio.Task[Any]] = []

    def spawn(coro: Coroutine[Any, Any, Any], _name: str) -> asyncio.Task[Any]:
        tasks.append(asyncio.create_task(coro))
        return tasks[-1]

    await nc.subscribe(subjects.heartbeat("prefill", "w1"), cb=on_beat)
    await subscribed(nc)
    sender = HeartbeatSender("w1", subjects, 0.5, 1, build=heartbeat,
                             roles=lambda: ["prefill"], nc=lambda: nc, spawn=spawn)
    try:
        await sender.send(is_registered=False)
        for _ in range(10):  # ten prefills drained the queue at once: one heartbeat
            sender.soon()
        await asyncio.sleep(EARLY_GAP_S * 4)
        assert len(beats) == 2
        assert beats[1] - beats[0] >= EARLY_GAP_S * 0.9
        asked_at = time.monotonic()
        sender.soon()  # long after the last: at once, not a gap later
        await eventually(lambda: len(beats) == 3)
        assert beats[2] - asked_at < EARLY_GAP_S
    finally:
        await asyncio.gather(*tasks)
        await nc.close()
