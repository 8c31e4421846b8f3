"""Requests a decode worker streams for no one, found and let go.

A gateway aborts a request whose client left (`AbortRequest`: core NATS, at most once), and
places the rest of a request elsewhere when it loses sight of its decode worker (a stall
past the heartbeat timeout, a partition), telling no worker it cannot reach; a gateway that
dies aborts nothing. Each time the worker would decode the request to its last token for no
one, holding its blocks and a place in every step. So every `CHECK_EVERY_S` it asks each
gateway it streams for (`OpenStreamsQuery`, on the gateway's status subject) which of its
requests a client still waits for, on the attempt it decodes, and lets the others go. A
gateway no one listens for (NATS says so) `GONE_AFTER` checks running is gone, and all of
its requests with it; no answer in time decides nothing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

import nats.errors

from shared.errors import WorkerUnavailable
from shared.logs import get_logger
from shared.messages import GenerateRequest, OpenStreamsQuery, StreamAttempt
from shared.nats_client import NatsClient, ask_open_streams

CHECK_EVERY_S = 5.0
ANSWER_WITHIN_S = 1.0
# Checks in a row that found no one listening on a gateway's subject: more than one, as a
# NATS cluster may lose a gateway's interest for a moment while a route reconnects. A
# gateway cut off from this worker for longer has failed its requests over already (it
# hears no heartbeat either, and its heartbeat timeout is shorter).
GONE_AFTER = 2

log = get_logger(__name__)


class OrphanFinder:
    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc
        self._unheard: Counter[str] = Counter()  # gateway subject -> checks no one listened

    async def find(self, requests: Iterable[GenerateRequest]) -> list[str]:
        """The ids, of `requests` (those decoding here), no client waits for any more."""
        by_gateway: dict[str, list[GenerateRequest]] = defaultdict(list)
        for request in requests:
            if request.status_subject:  # "": a gateway too old to be asked
                by_gateway[request.status_subject].append(request)
        for subject in set(self._unheard) - set(by_gateway):
            del self._unheard[subject]
        orphans: list[str] = []
        for subject, asked in by_gateway.items():
            query = OpenStreamsQuery(streams=[
                StreamAttempt(request_id=request.request_id, attempt=request.attempt)
                for request in asked])
            try:
                answer = await ask_open_streams(self._nc, subject, query, ANSWER_WITHIN_S)
            except (WorkerUnavailable, nats.errors.Error) as exc:
                log.info("orphans.no_answer", subject=subject, error=repr(exc))
                continue
            if answer is None:
                self._unheard[subject] += 1
                if self._unheard[subject] >= GONE_AFTER:
                    orphans += [request.request_id for request in asked]
                continue
            self._unheard.pop(subject, None)
            still_open = set(answer.request_ids)
            orphans += [request.request_id for request in asked
                        if request.request_id not in still_open]
        return orphans
