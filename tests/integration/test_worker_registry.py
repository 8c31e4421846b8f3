"""The worker registry read back from a real NATS KV bucket: every live entry, whatever the
state of nats-py's key watcher (its `keys()` can end early and report none)."""

from __future__ import annotations

import msgspec

from shared.jetstream_assets import ensure_bucket, read_registry
from shared.messages import WorkerHeartbeat
from shared.nats_client import connect, encode


def heartbeat(worker_id: str) -> WorkerHeartbeat:
    return WorkerHeartbeat(worker_id=worker_id, role="decode", model="m", host="h",
                           num_running=0, num_waiting=0, max_batch_size=8, num_free_blocks=10,
                           num_total_blocks=10, block_size=16, heartbeat_interval_s=0.5,
                           sent_at_s=1.0)


async def test_the_registry_lists_every_live_worker_and_none_that_left(nats_url: str) -> None:
    nc = await connect(nats_url, "registry-test")
    try:
        js = nc.jetstream()
        assert await read_registry(js, "no-such-bucket") == []
        kv = await ensure_bucket(js, "workers-test", 30.0)
        assert await read_registry(js, "workers-test") == []
        for worker_id in ("a", "b", "c"):
            await kv.put(worker_id, encode(heartbeat(worker_id)))
        await kv.put("b", encode(msgspec.structs.replace(heartbeat("b"), sent_at_s=2.0)))
        await kv.delete("c")  # left
        for _ in range(20):  # a read straight after writes, again and again
            found = sorted(await read_registry(js, "workers-test"),
                           key=lambda worker: worker.worker_id)
            assert [(w.worker_id, w.sent_at_s) for w in found] == [("a", 1.0), ("b", 2.0)]
    finally:
        await nc.close()
