"""The conductors' intake: the requests work queue, pulled through one durable consumer.

Conductor replicas share the consumer, so JetStream delivers each request to one of them.
Each replica keeps `num_fetchers` pulls open and hands every message to `handle` (which
acks, naks or terms it, or keeps it past its return: `InHand.keep`), telling JetStream every
second that a message is still in hand; a replica that dies with messages unacked has them
delivered again after `ack_wait`, and so does a delivery lost on its way (into a connection
a partition cut off). `ack_wait` is short for that, long enough for an ack held while the
conductor reconnects. While the stream's leader moves (a NATS node lost) a pull fails and is
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
from shared.jetstream_assets import (
    ASSET_WAIT_S,
    UNANSWERED_ERRORS,
    Redeclare,
    answered,
    ensure_work_queue,
)
from shared.logs import get_logger
from shared.subjects import Subjects

FETCH_RETRY_S = 0.25
# Pulls failing this long (longer than a leader election's usual few seconds) declare the
# stream and consumer again and pull through a new subscription; each try bounded.
REDECLARE_AFTER_S = 3.0
REDECLARE_LIMIT_S = 2.0
ACK_WAIT_S = 5.0  # was 10 s: a delivery lost in a partition held its request that long
IN_PROGRESS_EVERY_S = 1.0
LAPSED_AFTER = 0.8  # of ACK_WAIT_S without an in-progress word: maybe delivered again
STOOD_STILL_S = 0.25  # a pull's timeout this late: the loop stood still meanwhile
MAX_ACK_PENDING = 4096

log = get_logger(__name__)


class RequestIntake:
    def __init__(self, js: JetStreamContext, subjects: Subjects,
                 handle: Callable[[Msg, InHand], Awaitable[None]], *, max_age_s: float,
                 replicas: int = 1) -> None:
        self._js = js
        self._subjects = subjects
        self._handle = handle
        self._max_age_s = max_age_s
        self._replicas = replicas
        self._subscriptions: list[Any] = []
        self._is_fetching = False
        self._redeclare = Redeclare(self._declare_stream, "the request stream")
        self._spawn: Callable[[Coroutine[Any, Any, Any], str], Any] | None = None
        self.num_in_hand = 0  # messages being handled now

    async def start(self, num_fetchers: int,
                    spawn: Callable[[Coroutine[Any, Any, Any], str], Any]) -> None:
        await self._declare_stream()
        self._spawn = spawn
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

    async def _subscribe(self) -> Any:
        """A pull subscription on the durable consumer, made, or brought to these settings
        (one an older conductor made keeps its own otherwise: a longer ack_wait, say)."""
        subjects = self._subjects
        consumer = ConsumerConfig(
            durable_name=subjects.conductor_consumer, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S, max_deliver=holding.MAX_DELIVER,
            max_ack_pending=MAX_ACK_PENDING, filter_subject=subjects.requests)
        await self._js.add_consumer(subjects.requests_stream, consumer)
        return await self._js.pull_subscribe(
            subjects.requests, durable=subjects.conductor_consumer,
            stream=subjects.requests_stream, config=consumer)

    def _declare_stream(self) -> Awaitable[None]:
        return ensure_work_queue(self._js, self._subjects.requests_stream,
                                 self._subjects.requests, max_age_s=self._max_age_s,
                                 replicas=self._replicas)

    async def _fetch_loop(self, index: int) -> None:
        failing_since: float | None = None
        # A pull answered while this loop stood still (a stopped process) may have timed
        # out here all the same, its message left for the next fetch to return: that one
        # was delivered when that pull was made, or later.
        stood_pull_at: float | None = None
        while self._is_fetching:
            subscription = self._subscriptions[index]
            timeout_s = min(1.0, ACK_WAIT_S / 8)  # two pulls well inside the ack wait
            asked_at = time.monotonic()
            try:
                messages = await subscription.fetch(1, timeout=timeout_s)
            except (nats.errors.TimeoutError, TimeoutError):
                if time.monotonic() - asked_at > timeout_s + STOOD_STILL_S:
                    await asyncio.sleep(0.01)  # what came meanwhile is read in
                    if subscription.pending_msgs:
                        stood_pull_at = stood_pull_at or asked_at
                else:  # a pull that went by empty: nothing taken in then is left
                    stood_pull_at = None
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
            delivered_by, stood_pull_at = stood_pull_at or asked_at, None  # then or later
            for message in messages:
                self.num_in_hand += 1
                in_hand = InHand(message, self._say_in_progress, delivered_by)
                try:
                    await self._handle(message, in_hand)
                finally:
                    if not in_hand.is_kept:
                        in_hand.stop()
                    self.num_in_hand -= 1

    def _say_in_progress(self, message: Msg) -> None:
        assert self._spawn is not None  # set by `start`, before any fetch
        self._spawn(_in_progress(message), "requests.in_progress")

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


class InHand:
    """Tells JetStream every `IN_PROGRESS_EVERY_S` that a message is still being handled
    (it would be delivered again after `ack_wait` otherwise), until `stop()`; and says when
    it may have been delivered again meanwhile (`is_lapsed`), and says nothing more then."""

    def __init__(self, message: Msg, say: Callable[[Msg], None], delivered_by: float) -> None:
        self._message = message
        self._say = say
        self._loop = asyncio.get_running_loop()
        self._said_at = delivered_by  # JetStream's ack wait started then or later
        self._has_lapsed = False
        self._timer = self._loop.call_later(IN_PROGRESS_EVERY_S, self._tick)
        self.is_kept = False
        self.taken_at = time.perf_counter()  # placing it takes from here, its waits included

    def keep(self) -> None:
        """The handler keeps the message past its return (waiting for room): the word
        goes on until the handler's own `stop()`, and the fetch loop pulls the next."""
        self.is_kept = True

    def is_lapsed(self) -> bool:
        """Whether JetStream went most of its ack wait without word from us (this process
        was stopped, or its loop held): the message may be another conductor's now, and
        whatever this one sends for it would run the request twice. Once lapsed, always
        (the overdue tick that runs first on waking must not hide it)."""
        self._has_lapsed = self._has_lapsed or \
            time.monotonic() - self._said_at > LAPSED_AFTER * ACK_WAIT_S
        return self._has_lapsed

    def _tick(self) -> None:
        if self.is_lapsed():  # not ours to keep: JetStream's next delivery, not this word
            return
        self._said_at = time.monotonic()
        self._say(self._message)
        self._timer = self._loop.call_later(IN_PROGRESS_EVERY_S, self._tick)

    def stop(self) -> None:
        self._timer.cancel()


async def _in_progress(message: Msg) -> None:
    with contextlib.suppress(nats.errors.Error, OSError):  # acked meanwhile, or cut off
        await message.in_progress()
