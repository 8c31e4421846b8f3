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

from shared.messages import AbortRequest

MAX_REQUESTS = 65_536  # ended requests remembered (the oldest forgotten first)


class Abandoned:
    """The ids of the latest requests their gateways ended."""

    def __init__(self, max_requests: int = MAX_REQUESTS) -> None:
        self._max_requests = max_requests
        self._ids: dict[str, None] = {}  # insertion-ordered

    def note(self, abort: AbortRequest) -> bool:
        """Remember the request of an abort that ends it; whether it did."""
        if not abort.is_ended:
            return False
        self._ids[abort.request_id] = None
        if len(self._ids) > self._max_requests:
            del self._ids[next(iter(self._ids))]
        return True

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids
