"""Keeping a conductor's global prefix index current from the workers' KV events.

Start: restore the latest snapshot of the index (object store `Subjects.snapshot_bucket`),
then replay only the KV-event stream after the snapshot's sequence, and return once the
index has caught up with the stream as it was at start (bounded): placement sees every
cached prefix from its first request. Then follow the stream live (an ordered consumer: no
state on the server, restarted by the client if it falls out of order), and save a snapshot
every `snapshot_interval_s` when the index moved. Without a snapshot (the first conductor,
or one too new for the stream, or taken of a stream since made anew) the whole stream is
replayed, as before snapshots.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, StreamInfo
from nats.js.object_store import ObjectStore

from services.conductor.prefix_index import PrefixIndex
from shared.jetstream_assets import (
    ASSET_WAIT_S,
    Redeclare,
    answered,
    ensure_kv_event_stream,
    ensure_object_store,
)
from shared.logs import get_logger
from shared.messages import KvEventBatch, PrefixIndexSnapshot
from shared.nats_client import encode
from shared.subjects import Subjects

log = get_logger(__name__)

STREAM_CHECK_S = 2.0  # how often `keep_following` looks at the stream

_batch_decoder = msgspec.json.Decoder(KvEventBatch)
_snapshot_decoder = msgspec.json.Decoder(PrefixIndexSnapshot)


def made_at(info: StreamInfo) -> str:
    """When a stream was made, as a snapshot records it ("": unknown)."""
    return info.created.isoformat() if info.created is not None else ""


class PrefixIndexFollower:
    def __init__(self, js: JetStreamContext, subjects: Subjects, index: PrefixIndex, *,
                 replicas: int = 1) -> None:
        self._js = js
        self._replicas = replicas
        self._subjects = subjects
        self.index = index
        self.applied_seq = 0  # the last KV-event stream sequence in the index
        self.saved_seq = 0
        self.restored_from_seq = 0  # the snapshot's sequence; 0: replayed from the start
        self._subscription: Any = None
        self._store: ObjectStore | None = None
        self._stream_created: str | None = None  # when the stream followed was made
        self._redeclare = Redeclare(self._declare, "the KV-event stream")

    def _declare(self) -> Awaitable[None]:
        return ensure_kv_event_stream(self._js, self._subjects, replicas=self._replicas)

    async def start(self, catch_up_timeout_s: float) -> None:
        await self._declare()
        stream = self._subjects.kv_events_stream
        info = await answered(lambda: self._js.stream_info(stream), f"stream {stream}",
                              within_s=ASSET_WAIT_S)
        last_seq = info.state.last_seq
        self._stream_created = made_at(info)
        snapshot = await self._load()
        if snapshot is not None and snapshot.stream_seq <= last_seq and (
                snapshot.stream_created in ("", self._stream_created)):
            self.index.restore(snapshot)
            self.applied_seq = self.saved_seq = self.restored_from_seq = snapshot.stream_seq
        await self._follow()
        try:
            async with asyncio.timeout(catch_up_timeout_s):
                while self.applied_seq < last_seq:  # noqa: ASYNC110 - the callback advances it
                    await asyncio.sleep(0.005)
        except TimeoutError:
            log.warning("prefix_index.catch_up_timeout", applied_seq=self.applied_seq,
                        last_seq=last_seq)
        log.info("prefix_index.ready", blocks=len(self.index),
                 snapshot_seq=self.restored_from_seq, replayed=self.applied_seq
                 - self.restored_from_seq)

    async def _follow(self) -> None:
        """An ordered consumer from the event after `applied_seq` (all of them from 0)."""
        stream = self._subjects.kv_events_stream
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL) if not self.applied_seq \
            else ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=self.applied_seq + 1)
        self._subscription = await answered(lambda: self._js.subscribe(
            self._subjects.all_kv_events, stream=stream, cb=self._on_batch,
            ordered_consumer=True, config=config), f"a consumer of {stream}",
            within_s=ASSET_WAIT_S)

    async def keep_following(self, interval_s: float) -> None:
        """Every `interval_s`: a stream deleted (or lost with a server's store) is declared
        again, and one made anew since (by this or a worker that found it gone) is followed
        from its start: its sequence started over, below where the consumer would resume.
        The index keeps what it holds (hints, corrected by the events that follow)."""
        stream = self._subjects.kv_events_stream
        while True:
            await asyncio.sleep(interval_s)
            try:
                info = await self._js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                await self._redeclare()
                continue
            except (nats.errors.Error, nats.js.errors.Error):
                continue  # unanswered (an election, an outage): asked again next time
            created = made_at(info)
            if created == self._stream_created:
                continue
            log.warning("prefix_index.stream_made_anew", stream=stream,
                        applied_seq=self.applied_seq, last_seq=info.state.last_seq)
            await self.stop()
            self._stream_created = created
            self.applied_seq = self.saved_seq = 0
            try:
                await self._follow()
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning("prefix_index.follow_failed", error=repr(exc))
                self._stream_created = None  # tried again next time

    async def _on_batch(self, msg: Msg) -> None:
        self.applied_seq = max(self.applied_seq, msg.metadata.sequence.stream)
        try:
            self.index.apply(_batch_decoder.decode(msg.data))
        except msgspec.DecodeError as exc:
            log.warning("message.invalid", subject=msg.subject, error=str(exc))

    async def save_every(self, interval_s: float) -> None:
        """Save a snapshot every `interval_s` when the index moved since the last one."""
        while True:
            await asyncio.sleep(interval_s)
            if self.applied_seq > self.saved_seq:
                try:
                    await self.save()
                except (nats.errors.Error, nats.js.errors.Error) as exc:
                    log.warning("prefix_index.snapshot_failed", error=repr(exc))
                    self._store = None  # declared again for the next (it may be gone)

    async def save(self) -> None:
        seq = self.applied_seq
        snapshot = msgspec.structs.replace(self.index.snapshot(seq, time.time()),
                                           stream_created=self._stream_created or "")
        store = await self._object_store()
        await store.put(self._subjects.prefix_snapshot, encode(snapshot))
        self.saved_seq = seq

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    async def _load(self) -> PrefixIndexSnapshot | None:
        try:
            store = await self._object_store()
            result = await store.get(self._subjects.prefix_snapshot)
        except nats.js.errors.ObjectNotFoundError:
            return None
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("prefix_index.snapshot_unreadable", error=repr(exc))
            return None
        try:
            return _snapshot_decoder.decode(result.data or b"")
        except msgspec.DecodeError as exc:
            log.warning("prefix_index.snapshot_invalid", error=str(exc))
            return None

    async def _object_store(self) -> ObjectStore:
        if self._store is None:
            self._store = await ensure_object_store(self._js, self._subjects.snapshot_bucket,
                                                    replicas=self._replicas)
        return self._store
