"""A conductor's restart-to-ready time: the global prefix index replayed from the whole
KV-event stream against restored from a snapshot plus the events after it.

On an embedded NATS server, `--workers` workers' KV events build an index of `--blocks`
blocks; `--churn` more blocks per block were stored and evicted on the way (a real stream
holds more history than the index). A conductor then starts (its `start()` returns once the
index has caught up with the stream), in alternating rounds: with no snapshot (full replay),
and with a snapshot taken before the last `--tail` of the events. Prints the median
restart-to-ready time of each and their ratio, measured in the same run.

    python -m bench.prefix_snapshot --blocks 100000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import nats
import nats.js.errors

from services.conductor.service import ConductorService
from shared.config import ConductorConfig
from shared.jetstream_assets import ensure_kv_event_stream
from shared.logs import configure_logging
from shared.messages import KvBlockEvent, KvEventBatch
from shared.nats_client import encode
from shared.nats_server import EmbeddedNatsServer
from shared.subjects import Subjects

BATCH_EVENTS = 200


def history(num_blocks: int, num_workers: int, churn: float) -> list[KvEventBatch]:
    """Event batches whose net effect is `num_blocks` blocks spread over the workers."""
    batches = []
    num_churned = int(num_blocks * churn)
    for worker in range(num_workers):
        events = []
        for i in range(worker, num_blocks + num_churned, num_workers):
            block_hash = i.to_bytes(16, "big").hex()
            events.append(KvBlockEvent(kind="stored", block_hash=block_hash))
            if i >= num_blocks:  # churn: stored, then evicted
                events.append(KvBlockEvent(kind="removed", block_hash=block_hash))
        for start in range(0, len(events), BATCH_EVENTS):
            batches.append(KvEventBatch(worker_id=f"prefill-{worker}", block_size=16,
                                        events=events[start:start + BATCH_EVENTS]))
    return batches


async def publish(js: nats.js.JetStreamContext, subjects: Subjects,
                  batches: list[KvEventBatch]) -> None:
    acks = [js.publish(subjects.kv_events(b.worker_id), encode(b)) for b in batches]
    for start in range(0, len(acks), 500):  # bounded in flight
        await asyncio.gather(*acks[start:start + 500])


async def time_to_ready(nats_url: str, cluster: str) -> tuple[float, ConductorService]:
    service = ConductorService(ConductorConfig(
        nats_url=nats_url, cluster=cluster, log_level="warning",
        prefix_snapshot_interval_s=0, prefix_catch_up_timeout_s=600))
    started = time.perf_counter()
    await service.start()
    return time.perf_counter() - started, service


async def run(args: argparse.Namespace) -> None:
    server = EmbeddedNatsServer()
    url = server.start()
    subjects = Subjects(f"bench{uuid.uuid4().hex[:8]}")
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_kv_event_stream(js, subjects)
        batches = history(args.blocks, args.workers, args.churn)
        num_tail = max(1, int(len(batches) * args.tail))
        await publish(js, subjects, batches[:-num_tail])
        # The snapshot a running conductor would have saved before the tail came in.
        _, service = await time_to_ready(url, subjects.cluster)
        assert service.prefix_follower is not None
        await service.prefix_follower.save()
        await service.stop()
        await publish(js, subjects, batches[-num_tail:])
        store = await js.object_store(subjects.snapshot_bucket)
        snapshot = (await store.get(subjects.prefix_snapshot)).data or b""
        times: dict[str, list[float]] = {"replay": [], "snapshot": []}
        for _ in range(args.rounds):
            for mode in ("replay", "snapshot"):
                if mode == "replay":
                    await store.delete(subjects.prefix_snapshot)
                else:
                    await store.put(subjects.prefix_snapshot, snapshot)
                seconds, service = await time_to_ready(url, subjects.cluster)
                assert len(service.prefix_index) == args.blocks, len(service.prefix_index)
                await service.stop()
                times[mode].append(seconds)
        replay, restored = (statistics.median(times[m]) for m in ("replay", "snapshot"))
        print(f"index: {args.blocks} blocks from {args.workers} workers; stream: "
              f"{len(batches)} batches, {sum(len(b.events) for b in batches)} events; "
              f"snapshot: {len(snapshot) / 1e6:.1f} MB, tail {num_tail} batches")
        print(f"restart-to-ready, median of {args.rounds}: full replay {replay:.3f} s, "
              f"snapshot + tail {restored:.3f} s, ratio {restored / replay:.2f}x "
              f"({replay / restored:.1f}x faster)")
    finally:
        await nc.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--churn", type=float, default=1.0)
    parser.add_argument("--tail", type=float, default=0.01,
                        help="share of the event batches published after the snapshot")
    parser.add_argument("--rounds", type=int, default=3)
    configure_logging("warning", "console")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    main()
