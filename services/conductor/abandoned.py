"""Requests their gateway ended before a conductor placed them: dropped, not computed for
no one.

A client that leaves (a timeout of its own, a closed connection) while its request waits,
in a conductor's line for room or still queued in the request stream, makes its gateway
publish an abort that ends it (`AbortRequest.is_ended`). Workers drop what they hold of it;
the conductors note it here, and one that holds it or pulls it later acks it and places
nothing. Under a backlog this is where clients give up, and each request placed for no one
took a prefill and decode KV from those still waited for.
"""

from __future__ import annotations

from nats.aio.msg import Msg
from opentelemetry.trace import Span
from prometheus_client import Counter

from services.conductor.room_lines import RoomLines
from shared.logs import get_logger
from shared.messages import AbortRequest, GenerateRequest

log = get_logger(__name__)

MAX_REQUESTS = 65_536  # ended requests remembered (the oldest forgotten first)


class Abandoned:
    """The ids of the latest requests their gateways ended; what waits of them in
    `room_lines` is woken to be dropped, and `dropped` counts them."""

    def __init__(self, room_lines: RoomLines, dropped: Counter,
                 max_requests: int = MAX_REQUESTS) -> None:
        self._room_lines = room_lines
        self._dropped = dropped
        self._max_requests = max_requests
        self._ids: dict[str, None] = {}  # insertion-ordered

    async def on_abort(self, abort: AbortRequest) -> None:
        """An abort on the bus: one that ends its request is remembered, and the request,
        if it waits in line, tries again now (and is dropped)."""
        if not abort.is_ended:
            return
        self._ids[abort.request_id] = None
        if len(self._ids) > self._max_requests:
            del self._ids[next(iter(self._ids))]
        self._room_lines.wake(abort.request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    async def drop(self, request: GenerateRequest, msg: Msg, schedule: Span | None = None
                   ) -> None:
        """Settle the delivery of an abandoned request: acked, placed nowhere."""
        log.info("request.abandoned", request_id=request.request_id)
        if schedule is not None:
            schedule.add_event("abandoned")
        self._dropped.inc()
        await msg.ack()
