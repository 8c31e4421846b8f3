"""The conductors' intake: the requests work queue, pulled through one durable consumer.

Conductor replicas share the consumer, so JetStream delivers each request to one of them.
Each replica keeps `num_fetchers` pulls open and hands every message to `handle` (which
acks, naks or terms it); a replica that dies with messages unacked has them delivered again
after `ack_wait`. While the stream's leader moves (a NATS node lost) a pull fails and is
tried again; pulls failing for longer declare the stream and the consumer again (they may be
gone: deleted, or lost with a server that restarted without its store).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from services.conductor import holding
from shared.logs import get_logger
from shared.nats_client import (
    ASSET_WAIT_S,
    UNANSWERED_ERRORS,
    Redeclare,
    answered,
    ensure_work_queue,
)
from shared.subjects import Subjects

FETCH_RETRY_S = 0.25
# Pulls failing this long (longer than a leader election's usual few seconds) declare the
# stream and consumer again and pull through a new subscription; each try bounded.
REDECLARE_AFTER_S = 3.0
REDECLARE_LIMIT_S = 2.0
ACK_WAIT_S = 10.0
MAX_ACK_PENDING = 4096

log = get_logger(__name__)


class RequestIntake:
    def __init__(self, js: JetStreamContext, subjects: Subjects,
                 handle: Callable[[Msg], Awaitable[None]], *, max_age_s: float,
                 replicas: int = 1) -> None:
        self._js = js
        self._subjects = subjects
        self._handle = handle
        self._max_age_s = max_age_s
        self._replicas = replicas
        self._subscriptions: list[Any] = []
        self._is_fetching = False
        self._redeclare = Redeclare(self._declare_stream, "the request stream")
        self.num_in_hand = 0  # messages being handled now

    async def start(self, num_fetchers: int,
                    spawn: Callable[[Coroutine[Any, Any, Any], str], Any]) -> None:
        await self._declare_stream()
        self._is_fetching = True
        for i in range(num_fetchers):
            subscription = await answered(self._subscribe, "the conductors' consumer",
                                          within_s=ASSET_WAIT_S)
            self._subscriptions.append(subscription)
            spawn(self._fetch_loop(i), f"fetch.{i}")

    def stop(self) -> None:
        """Pull no more; messages in hand are still handled."""
        self._is_fetching = False

    async def close(self) -> None:
        # A pull subscription may hold a message delivered to a fetch that was cancelled;
        # unsubscribing hands it back to the stream (it is redelivered after ack_wait) and
        # keeps the NATS drain from waiting on it.
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    def _subscribe(self) -> Awaitable[Any]:
        """A pull subscription on the durable consumer (created if missing)."""
        consumer = ConsumerConfig(
            durable_name=self._subjects.conductor_consumer, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S, max_deliver=holding.MAX_DELIVER,
            max_ack_pending=MAX_ACK_PENDING)
        return self._js.pull_subscribe(
            self._subjects.requests, durable=self._subjects.conductor_consumer,
            stream=self._subjects.requests_stream, config=consumer)

    def _declare_stream(self) -> Awaitable[None]:
        return ensure_work_queue(self._js, self._subjects.requests_stream,
                                 self._subjects.requests, max_age_s=self._max_age_s,
                                 replicas=self._replicas)

    async def _fetch_loop(self, index: int) -> None:
        failing_since: float | None = None
        while self._is_fetching:
            subscription = self._subscriptions[index]
            try:
                messages = await subscription.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            except (*UNANSWERED_ERRORS, nats.js.errors.NotFoundError) as exc:
                log.info("requests.fetch_retry", error=repr(exc))
                now_s = time.monotonic()
                failing_since = failing_since or now_s
                if now_s - failing_since >= REDECLARE_AFTER_S:
                    await self._resubscribe(index)
                await asyncio.sleep(FETCH_RETRY_S)
                continue
            failing_since = None
            for message in messages:
                self.num_in_hand += 1
                try:
                    await self._handle(message)
                finally:
                    self.num_in_hand -= 1

    async def _resubscribe(self, index: int) -> None:
        """Pulls failing this long: the stream or the consumer may be gone (deleted, or lost
        with a server that restarted without its store). Declare the stream again, and pull
        through a new subscription (which declares the consumer)."""
        await self._redeclare()
        try:
            subscription = await asyncio.wait_for(self._subscribe(), REDECLARE_LIMIT_S)
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as exc:
            log.info("requests.resubscribe_failed", error=repr(exc))
            return
        old, self._subscriptions[index] = self._subscriptions[index], subscription
        with contextlib.suppress(Exception):
            await old.unsubscribe()
