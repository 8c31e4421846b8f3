"""The conductors' intake: the requests work queue, pulled through one durable consumer.

Conductor replicas share the consumer, so JetStream delivers each request to one of them.
Each replica keeps `num_fetchers` pulls open and hands every message to `handle` (which
acks, naks or terms it); a replica that dies with messages unacked has them delivered again
after `ack_wait`. While the stream's leader moves (a NATS node lost) a pull fails and is
tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from services.conductor import holding
from shared.logs import get_logger
from shared.nats_client import ASSET_WAIT_S, UNANSWERED_ERRORS, answered
from shared.subjects import Subjects

FETCH_RETRY_S = 0.25
ACK_WAIT_S = 10.0
MAX_ACK_PENDING = 4096

log = get_logger(__name__)


class RequestIntake:
    def __init__(self, js: JetStreamContext, subjects: Subjects,
                 handle: Callable[[Msg], Awaitable[None]]) -> None:
        self._js = js
        self._subjects = subjects
        self._handle = handle
        self._subscriptions: list[Any] = []
        self._is_fetching = False
        self.num_in_hand = 0  # messages being handled now

    async def start(self, num_fetchers: int,
                    spawn: Callable[[Coroutine[Any, Any, Any], str], Any]) -> None:
        consumer = ConsumerConfig(
            durable_name=self._subjects.conductor_consumer, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S, max_deliver=holding.MAX_DELIVER,
            max_ack_pending=MAX_ACK_PENDING)
        self._is_fetching = True
        for i in range(num_fetchers):
            subscription = await answered(lambda: self._js.pull_subscribe(
                self._subjects.requests, durable=self._subjects.conductor_consumer,
                stream=self._subjects.requests_stream, config=consumer,
            ), "the conductors' consumer", within_s=ASSET_WAIT_S)
            self._subscriptions.append(subscription)
            spawn(self._fetch_loop(subscription), f"fetch.{i}")

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

    async def _fetch_loop(self, subscription: Any) -> None:
        while self._is_fetching:
            try:
                messages = await subscription.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            except UNANSWERED_ERRORS as exc:
                log.info("requests.fetch_retry", error=repr(exc))
                await asyncio.sleep(FETCH_RETRY_S)
                continue
            for message in messages:
                self.num_in_hand += 1
                try:
                    await self._handle(message)
                finally:
                    self.num_in_hand -= 1
