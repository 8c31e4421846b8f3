"""Publishing the public request-lifecycle events (`RequestEvent`).

Events are facts for outside subscribers, never part of serving: a publish that fails is
logged and dropped, it never fails or slows the request it describes (core NATS buffers the
publish; nothing waits for a reply).
"""

from __future__ import annotations

import time
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient

from shared.logs import get_logger
from shared.messages import KvLeaseEvent, RequestEvent, RequestEventKind
from shared.nats_client import encode
from shared.subjects import Subjects

log = get_logger(__name__)


class EventPublisher:
    """One per service: stamps `source` and `at_s` on every event it publishes."""

    def __init__(self, nc: NatsClient, subjects: Subjects, source: str) -> None:
        self._nc = nc
        self._subjects = subjects
        self._source = source

    async def request(self, kind: RequestEventKind, request_id: str, **fields: Any) -> None:
        event = RequestEvent(kind=kind, request_id=request_id, source=self._source,
                             at_s=time.time(), **fields)
        try:
            await self._nc.publish(self._subjects.request_event(kind), encode(event))
        except nats.errors.Error as exc:
            log.warning("event.publish_failed", kind=kind, request_id=request_id,
                        error=repr(exc))

    async def lease(self, event: KvLeaseEvent) -> None:
        try:
            await self._nc.publish(self._subjects.kv_lease_event(event.action), encode(event))
        except nats.errors.Error as exc:
            log.warning("event.publish_failed", kind=event.kind, action=event.action,
                        request_id=event.request_id, error=repr(exc))
