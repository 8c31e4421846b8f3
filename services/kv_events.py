"""A worker's prefix-cache events, published for the conductors' global prefix index.

The engine's prefix cache records each block it caches or evicts; this publisher drains
those records into `KvEventBatch`es on the worker's KV-event subject of the JetStream stream
the conductors follow (`services/conductor/prefix_follower.py`). Soon after a prefill
completes (`publish_soon`, calls coalescing) and at every heartbeat. Events that could not
be published are kept for the next try. A batch is a reset (`is_reset`: the whole cache,
superseding every earlier event) at start, and whenever the stream is found made anew (its
sequence went back: deleted, or lost with a server's store), since a conductor that starts
then would never learn of the blocks cached before.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors

from engine.protocol import PrefixCache
from shared.jetstream_assets import Redeclare, ensure_kv_event_stream, publish_to_stream
from shared.logs import get_logger
from shared.messages import KvBlockEvent, KvEventBatch
from shared.nats_client import encode
from shared.nats_headers import NatsClient
from shared.subjects import Subjects

log = get_logger(__name__)


class KvEventPublisher:
    """Publishes one worker's KV events; `cache` and `nc` are read at each publish."""

    def __init__(self, worker_id: str, block_size: int, subjects: Subjects, *,
                 cache: Callable[[], PrefixCache], nc: Callable[[], NatsClient],
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
                 replicas: int) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.subjects = subjects
        self._cache = cache
        self._nc = nc
        self._spawn = spawn
        self._replicas = replicas
        self._redeclare = Redeclare(self.declare, "the KV-event stream")
        self._unsent: list[KvBlockEvent] = []  # drained, not yet published
        self._is_reset_due = True  # the first batch announces the whole cache
        self._seq = 0  # the stream sequence of this worker's last batch
        self._flush: asyncio.Task[None] | None = None

    async def declare(self) -> None:
        await ensure_kv_event_stream(self._nc().jetstream(), self.subjects,
                                     replicas=self._replicas)

    def publish_soon(self) -> None:
        """The prefix cache changed (a prefill completed): tell the conductors now rather
        than at the next heartbeat, so that the next placement sees it. Calls coalesce."""
        if self._flush is None:
            self._flush = self._spawn(self._publish_all(), "kv-events")

    async def _publish_all(self) -> None:
        try:
            while await self.publish():
                pass
        except nats.errors.Error as exc:  # kept: the next heartbeat's flush sends them
            log.warning("kv_events.publish_failed", error=repr(exc),
                        num_unsent=len(self._unsent))
        finally:
            self._flush = None

    async def publish(self) -> bool:
        """Tell the conductors' prefix index what this worker's cache gained and lost (or,
        when a reset is due, all it holds); return whether there was anything to tell."""
        cache = self._cache()
        self._unsent += [
            KvBlockEvent(kind=kind, block_hash=block_hash.hex())  # type: ignore[arg-type]
            for kind, block_hash in cache.drain_kv_events()]
        is_reset = self._is_reset_due
        if is_reset:  # the whole state supersedes the events drained so far
            self._unsent = [KvBlockEvent(kind="stored", block_hash=block_hash.hex())
                            for block_hash in cache.held_block_hashes()]
        elif not self._unsent:
            return False
        batch = KvEventBatch(worker_id=self.worker_id, block_size=self.block_size,
                             events=self._unsent, is_reset=is_reset)
        ack = await publish_to_stream(self._nc().jetstream(),
                                      self.subjects.kv_events(self.worker_id), encode(batch),
                                      msg_id=uuid.uuid4().hex, redeclare=self._redeclare)
        self._unsent = []
        self._is_reset_due = False
        if ack.seq < self._seq:  # a stream's sequence never goes back: a new one
            log.info("kv_events.stream_renewed", seq=ack.seq, last_seq=self._seq)
            self._is_reset_due = True
        self._seq = ack.seq
        return True
