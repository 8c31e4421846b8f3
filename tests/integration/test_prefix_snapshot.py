"""A restarting conductor resumes its prefix index from a snapshot plus the events after it."""

from __future__ import annotations

import uuid

from services.conductor.service import ConductorService
from shared.config import ConductorConfig
from shared.jetstream_assets import ensure_kv_event_stream
from shared.messages import KvBlockEvent, KvEventBatch
from shared.nats_client import encode
from shared.subjects import Subjects
from tests.stack import Stack, eventually


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


async def test_a_snapshot_of_a_stream_since_made_anew_is_not_restored(nats_url: str) -> None:
    """A snapshot counts in its own stream's sequence: the stream made anew since starts
    over, and restoring the snapshot there would skip the new stream's first events (a
    worker's announcement of its whole cache among them). The whole new stream is replayed
    instead."""
    subjects = Subjects(f"t{uuid.uuid4().hex[:10]}")
    first = conductor(nats_url, subjects.cluster)
    await first.start()
    js = first.nc.jetstream()
    try:
        for message in (batch("a", "h1"), batch("a", "h2"), batch("a", "h3")):
            await js.publish(subjects.kv_events("a"), encode(message))
        follower = first.prefix_follower
        assert follower is not None
        await eventually(lambda: follower.applied_seq == 3)
        await follower.save()
        await js.delete_stream(subjects.kv_events_stream)
        await ensure_kv_event_stream(js, subjects)
        for message in (batch("b", "h7"), batch("b", "h8"), batch("b", "h9"), batch("b", "h6")):
            await js.publish(subjects.kv_events("b"), encode(message))
    finally:
        await first.stop()
    second = conductor(nats_url, subjects.cluster)
    await second.start()
    try:
        assert second.prefix_follower is not None
        assert second.prefix_follower.restored_from_seq == 0
        query = [name.encode().ljust(16, b"-") for name in ("h7", "h8", "h9", "h6")]
        assert all(second.prefix_index.leading_blocks([h], ["b"]) == {"b": 1} for h in query)
        assert second.prefix_index.leading_blocks([b"h1".ljust(16, b"-")], ["a"]) == {"a": 0}
    finally:
        await second.stop()


async def test_workers_announce_their_whole_cache_into_a_stream_made_anew(
        nats_url: str) -> None:
    """The KV-event stream lost under a running stack: the workers' caches are intact, their
    past events gone. A worker's next batch finds the stream's sequence gone back and it
    announces all it holds (`is_reset`), so a conductor that starts then knows the blocks
    cached before the loss; before, it knew only those cached since."""
    async with Stack(nats_url) as stack:
        body = {"model": "halfmoon-tiny", "prompt": "cached before the loss " * 8,
                "max_tokens": 2, "temperature": 0}
        assert (await stack.post("/v1/completions", body))[0] == 200
        prefill = stack.prefills[0]
        before = prefill.engine.prefix_cache.held_block_hashes()
        assert len(before) >= 4
        js = stack.gateway.nc.jetstream()
        subjects = stack.gateway.subjects
        info = await js.stream_info(subjects.kv_events_stream)
        assert info.state.last_seq >= 3  # both workers' start, then the prompt's blocks
        await js.delete_stream(subjects.kv_events_stream)
        await ensure_kv_event_stream(js, subjects)
        body["prompt"] = "cached after it " * 8
        assert (await stack.post("/v1/completions", body))[0] == 200
        late = conductor(nats_url, stack.cluster)
        await late.start()
        try:
            await eventually(lambda: all(
                late.prefix_index.leading_blocks([h], [prefill.worker_id]) ==
                {prefill.worker_id: 1} for h in before), timeout_s=10)
        finally:
            await late.stop()
