"""The conductors' intake on a real nats-server: a request in hand stays with its conductor
however long it takes; the consumer's ack_wait is short, also on a consumer an older
conductor made; the request stream keeps the longest max age asked of it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from services.conductor import intake
from services.conductor.intake import InHand, RequestIntake
from shared.jetstream_assets import ensure_work_queue
from shared.nats_client import NatsClient, connect
from shared.subjects import Subjects

pytestmark = pytest.mark.e2e


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await connect(nats_url, "intake-test")
    yield client
    await client.close()


class Tasks:
    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        return task

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def one_request_through(nc: NatsClient, subjects: Subjects,
                              handle: Callable[[Msg, InHand], Awaitable[None]], *,
                              for_s: float) -> None:
    """An intake with two pulls (the second free to take a redelivery) handling one
    request for `for_s` seconds."""
    tasks = Tasks()
    requests = RequestIntake(nc.jetstream(), subjects, handle, max_age_s=60)
    await requests.start(2, tasks.spawn)
    try:
        await nc.jetstream().publish(subjects.requests, b"{}")
        await asyncio.sleep(for_s)
    finally:
        requests.stop()
        await tasks.cancel()
        await requests.close()


async def test_a_request_in_hand_longer_than_ack_wait_is_delivered_once(
        nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its conductor says it is in progress every second: JetStream does not hand it to the
    next pull (before, with no word, a request placed for longer than ack_wait went to a
    second conductor too)."""
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)
    monkeypatch.setattr(intake, "IN_PROGRESS_EVERY_S", 0.25)
    subjects = Subjects("intake-slow")
    deliveries: list[int] = []
    lapsed: list[bool] = []

    async def handle(message: Msg, in_hand: InHand) -> None:
        deliveries.append(message.metadata.num_delivered)
        await asyncio.sleep(3.0)  # three ack_waits
        lapsed.append(in_hand.is_lapsed())
        await message.ack()

    await one_request_through(nc, subjects, handle, for_s=4.0)
    assert deliveries == [1] and lapsed == [False]


async def test_a_request_held_by_a_stopped_loop_lapses_and_is_delivered_again(
        nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conductor whose loop stood still past most of the ack wait (a SIGSTOPped process, a
    blocked loop) cannot have said "in progress": the request may be another's now, and the
    conductor learns so before it sends anything more for it."""
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)
    monkeypatch.setattr(intake, "IN_PROGRESS_EVERY_S", 0.25)
    subjects = Subjects("intake-stopped")
    deliveries: list[tuple[int, bool]] = []

    async def handle(message: Msg, in_hand: InHand) -> None:
        if message.metadata.num_delivered == 1:
            await asyncio.sleep(0.3)  # a tick or so: still current
            assert not in_hand.is_lapsed()
            time.sleep(1.5)  # noqa: ASYNC251 (the loop stands still, as if stopped)
            await asyncio.sleep(0)  # the overdue tick runs first on waking
        deliveries.append((message.metadata.num_delivered, in_hand.is_lapsed()))
        if not in_hand.is_lapsed():
            await message.ack()

    await one_request_through(nc, subjects, handle, for_s=3.0)
    assert deliveries == [(1, True), (2, False)]


async def test_a_lapsed_request_gets_no_more_word_from_the_conductor_that_stood_still(
        nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its lapse its conductor says nothing more of it: its "in progress" would also
    put off the next delivery (the same message), and were that one lost too (the second
    conductor stopped) the request would wait for as long as the first stayed in hand."""
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)
    monkeypatch.setattr(intake, "IN_PROGRESS_EVERY_S", 0.25)
    subjects = Subjects("intake-lapsed")
    deliveries: list[int] = []

    async def handle(message: Msg, in_hand: InHand) -> None:
        deliveries.append(message.metadata.num_delivered)
        if message.metadata.num_delivered == 1:
            time.sleep(1.5)  # noqa: ASYNC251 (the loop stands still, as if stopped)
            await asyncio.sleep(3.0)  # then holds it on, as a placement it finishes would
        # Later deliveries are dropped unanswered: their conductor stopped for good.

    await one_request_through(nc, subjects, handle, for_s=4.0)
    assert deliveries[:3] == [1, 2, 3]


async def test_a_consumer_an_older_conductor_made_gets_the_short_ack_wait(
        nc: NatsClient) -> None:
    subjects = Subjects("intake-older")
    js = nc.jetstream()
    await ensure_work_queue(js, subjects.requests_stream, subjects.requests, max_age_s=60)
    await js.add_consumer(subjects.requests_stream, ConsumerConfig(
        durable_name=subjects.conductor_consumer, ack_policy=AckPolicy.EXPLICIT, ack_wait=10.0,
        filter_subject=subjects.requests))
    tasks = Tasks()
    requests = RequestIntake(js, subjects, lambda message, _: message.ack(), max_age_s=60)
    await requests.start(1, tasks.spawn)
    try:
        info = await js.consumer_info(subjects.requests_stream, subjects.conductor_consumer)
    finally:
        requests.stop()
        await tasks.cancel()
        await requests.close()
    assert info.config.ack_wait == intake.ACK_WAIT_S
    assert info.config.filter_subject == subjects.requests


async def test_a_request_after_the_loop_stood_still_idle_is_not_taken_for_lapsed(
        nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop stood still while its pulls waited for nothing (a stopped conductor with no
    request in hand): a request that comes a while after it woke is current. Before, the
    pull that stood still stayed on record until the next message, and that message was
    dated from it: lapsed on arrival, let go, and placed only after the ack wait (a request
    5 s late on a conductor SIGSTOPped and continued, `halfmoon up` with the torch engine)."""
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)
    monkeypatch.setattr(intake, "IN_PROGRESS_EVERY_S", 0.25)
    subjects = Subjects("intake-idle-stood")
    seen: list[tuple[int, bool]] = []

    async def handle(message: Msg, in_hand: InHand) -> None:
        seen.append((message.metadata.num_delivered, in_hand.is_lapsed()))
        await message.ack()

    tasks = Tasks()
    requests = RequestIntake(nc.jetstream(), subjects, handle, max_age_s=60)
    await requests.start(2, tasks.spawn)
    try:
        await asyncio.sleep(0.3)  # both pulls waiting
        time.sleep(1.5)  # noqa: ASYNC251 (the loop stands still, as if stopped)
        await asyncio.sleep(2.0)  # awake: pulls come and go, empty
        await nc.jetstream().publish(subjects.requests, b"{}")
        await asyncio.sleep(1.0)
    finally:
        requests.stop()
        await tasks.cancel()
        await requests.close()
    assert seen == [(1, False)]


async def test_the_request_stream_keeps_the_longest_max_age_asked(nc: NatsClient) -> None:
    """A gateway that waits 300 s for its requests and a conductor whose
    `request_max_age_s` is 60 declare the same stream: it keeps requests 300 s whichever
    starts last (before, the last one's age won, and could cut the gateway's requests
    short)."""
    subjects = Subjects("intake-ages")
    js = nc.jetstream()

    async def max_age_s() -> float:
        return (await js.stream_info(subjects.requests_stream)).config.max_age or 0.0

    await ensure_work_queue(js, subjects.requests_stream, subjects.requests, max_age_s=60)
    await ensure_work_queue(js, subjects.requests_stream, subjects.requests, max_age_s=300)
    assert await max_age_s() == 300
    await ensure_work_queue(js, subjects.requests_stream, subjects.requests, max_age_s=60)
    assert await max_age_s() == 300
    await js.delete_stream(subjects.requests_stream)
