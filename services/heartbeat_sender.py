"""A worker's heartbeats: published on its role's subjects (and the role it is leaving), kept
as its entry in the registry bucket, and sent early when work the conductors count as
pending here may be done.

Conductors count what they sent a worker since its last heartbeat as its pending work, on
top of the queue that heartbeat reported, and clear it at the next one. A prefill that ends
long before that next heartbeat (0.5 s by default) left its tokens counted as queued: a
client sending long prompts one after another was refused with a predicted TTFT that added
up prompts computed long ago. So a prefill that leaves its worker's queue empty asks for a
heartbeat soon (`soon`), at most one per `EARLY_GAP_S` (calls coalesce): the next placement
sees the queue as it is, and a fresh worker's first measured step cost with it. A worker
with a queue sends none early: its heartbeats' queue is what is pending there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from shared.jetstream_assets import Redeclare, ensure_bucket
from shared.logs import get_logger
from shared.messages import WorkerHeartbeat, WorkerRole
from shared.nats_client import encode
from shared.subjects import Subjects

log = get_logger(__name__)

# Registry entries outlive a few missed heartbeats, then the bucket drops them.
REGISTRY_TTL_HEARTBEATS = 10
EARLY_GAP_S = 0.05  # early heartbeats: at most 20 a second

Spawn = Callable[[Any, str], "asyncio.Task[None]"]


class HeartbeatSender:
    """Publishes `build()` on the heartbeat subject of each of `roles()`; `nc()` is the
    worker's connection, `spawn` its task owner."""

    def __init__(self, worker_id: str, subjects: Subjects, interval_s: float, replicas: int,
                 *, build: Callable[[], WorkerHeartbeat],
                 roles: Callable[[], Iterable[WorkerRole]],
                 nc: Callable[[], Client], spawn: Spawn) -> None:
        self.worker_id = worker_id
        self.subjects = subjects
        self.interval_s = interval_s
        self.replicas = replicas
        self._build, self._roles, self._nc, self._spawn = build, roles, nc, spawn
        self._registry: KeyValue | None = None
        self._registry_put: asyncio.Task[None] | None = None
        # The registry bucket found gone (deleted, or lost with a server's store): declared
        # again.
        self._redeclare = Redeclare(self.open_registry, "the worker registry")
        self._sent_at = 0.0  # monotonic
        self._early: asyncio.Task[None] | None = None

    async def open_registry(self) -> None:
        self._registry = await ensure_bucket(
            self._nc().jetstream(), self.subjects.workers_bucket,
            ttl_s=max(5.0, REGISTRY_TTL_HEARTBEATS * self.interval_s),
            replicas=self.replicas,
        )

    async def send(self, *, is_registered: bool = True) -> None:
        """Publish the heartbeat now; with `is_registered`, put it in the registry too."""
        payload = encode(self._build())
        self._sent_at = time.monotonic()
        # Also on the subject of a role it is leaving, while it finishes the work it took
        # there: a decode worker holding KV for this worker's queued prefills hears prefill
        # heartbeats only, and took a worker moved to decode for lost four intervals later,
        # dropping those reservations (the requests were placed and prefilled again).
        for role in self._roles():
            await self._nc().publish(self.subjects.heartbeat(role, self.worker_id), payload)
        if is_registered and self._registry is not None and self._registry_put is None:
            # Beside the heartbeat, never before the next one: while the bucket's leader
            # moves (a NATS node lost) a put waits seconds, and heartbeats held up behind it
            # made every conductor judge every worker lost at once. A put still in flight
            # skips this one; the next heartbeat puts a fresher entry.
            self._registry_put = self._spawn(self._put(payload), "registry-put")

    def soon(self) -> None:
        """Work counted as pending here may be done: a heartbeat (not put in the registry)
        now, or `EARLY_GAP_S` after the last one. Calls coalesce."""
        if self._early is None:
            self._early = self._spawn(self._send_early(), "heartbeat-soon")

    async def registered(self) -> None:
        """Wait for the registry put in flight, if any."""
        if self._registry_put is not None:
            await self._registry_put

    async def deregister(self) -> None:
        if self._registry is not None:
            with contextlib.suppress(Exception):  # briefly: NATS may be gone at shutdown
                await asyncio.wait_for(self._registry.delete(self.worker_id), 1.0)

    async def _send_early(self) -> None:
        try:
            wait_s = self._sent_at + EARLY_GAP_S - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if not self._nc().is_closed:
                await self.send(is_registered=False)
        except nats.errors.Error as exc:  # the next heartbeat tells the same, fresher
            log.debug("heartbeat.early_failed", error=repr(exc))
        finally:
            self._early = None

    async def _put(self, payload: bytes) -> None:
        try:
            if self._registry is not None:
                await self._registry.put(self.worker_id, payload)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("registry.put_failed", error=repr(exc))
            if isinstance(exc, nats.js.errors.NoStreamResponseError):
                await self._redeclare()  # the bucket may be gone
        finally:
            self._registry_put = None
