"""A restarting conductor resumes its prefix index from a snapshot plus the events after it."""

from __future__ import annotations

import uuid

from services.conductor.service import ConductorService
from shared.config import ConductorConfig
from shared.messages import KvBlockEvent, KvEventBatch
from shared.nats_client import encode, ensure_kv_event_stream
from shared.subjects import Subjects
from tests.stack import eventually


def batch(worker: str, *names: str) -> KvEventBatch:
    return KvEventBatch(worker_id=worker, block_size=16, events=[
        KvBlockEvent(kind="stored", block_hash=name.encode().ljust(16, b"-").hex())
        for name in names])


def conductor(nats_url: str, cluster: str) -> ConductorService:
    return ConductorService(ConductorConfig(nats_url=nats_url, cluster=cluster,
                                            log_level="warning", prefix_snapshot_interval_s=0))


async def test_a_new_conductor_replays_only_the_events_after_the_snapshot(
        nats_url: str) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
    first = conductor(nats_url, subjects.cluster)
    await first.start()
    js = first.nc.jetstream()
    await ensure_kv_event_stream(js, subjects)
    for message in (batch("a", "h1", "h2"), batch("b", "h1"), batch("a", "h3")):
        await js.publish(subjects.kv_events(message.worker_id), encode(message))
    second = conductor(nats_url, subjects.cluster)
    try:
        assert first.prefix_follower is not None
        follower = first.prefix_follower
        await eventually(lambda: follower.applied_seq == 3)
        await follower.save()
        for message in (batch("b", "h2"), batch("c", "h1")):
            await js.publish(subjects.kv_events(message.worker_id), encode(message))
        await second.start()
        assert second.prefix_follower is not None
        assert second.prefix_follower.restored_from_seq == 3
        assert second.prefix_follower.applied_seq == 5  # caught up before start() returned
        query = [name.encode().ljust(16, b"-") for name in ("h1", "h2", "h3")]
        assert second.prefix_index.leading_blocks(query, ["a", "b", "c"]) == {
            "a": 3, "b": 2, "c": 1}
    finally:
        await second.stop()
        await first.stop()


async def test_without_a_snapshot_the_whole_stream_is_replayed(nats_url: str) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
    service = conductor(nats_url, subjects.cluster)
    await service.start()
    try:
        js = service.nc.jetstream()
        await js.publish(subjects.kv_events("a"), encode(batch("a", "h1")))
        restarted = conductor(nats_url, subjects.cluster)
        await restarted.start()
        try:
            assert restarted.prefix_follower is not None
            assert restarted.prefix_follower.restored_from_seq == 0
            assert len(restarted.prefix_index) == 1
        finally:
            await restarted.stop()
    finally:
        await service.stop()


async def test_a_stream_declared_anew_is_followed_from_its_start(nats_url: str) -> None:
    """The KV-event stream deleted and declared again (by a worker that found it gone) starts
    its sequence over, below where the conductor's consumer would resume: the conductor
    follows the new stream from its start."""
    subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
    service = conductor(nats_url, subjects.cluster)
    await service.start()
    try:
        js = service.nc.jetstream()
        for message in (batch("a", "h1"), batch("a", "h2"), batch("a", "h3")):
            await js.publish(subjects.kv_events("a"), encode(message))
        follower = service.prefix_follower
        assert follower is not None
        await eventually(lambda: follower.applied_seq == 3)
        await js.delete_stream(subjects.kv_events_stream)
        await ensure_kv_event_stream(js, subjects)
        await js.publish(subjects.kv_events("b"), encode(batch("b", "h9")))
        query = [b"h9".ljust(16, b"-")]
        await eventually(lambda: service.prefix_index.leading_blocks(query, ["b"]) == {"b": 1},
                         timeout_s=10)
    finally:
        await service.stop()
