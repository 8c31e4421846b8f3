"""`subscribed`: once it returns, the server has the subscription, so a message another
connection publishes right after reaches it (core NATS keeps nothing for a late subscriber)."""

from __future__ import annotations

import nats
import nats.aio.msg

from shared.nats_client import subscribed
from tests.stack import eventually


async def test_a_message_published_elsewhere_right_after_subscribed_is_received(
        nats_url: str) -> None:
    listener, publisher = await nats.connect(nats_url), await nats.connect(nats_url)
    received: set[str] = set()

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        received.add(msg.subject)

    subjects = [f"test.subscribed.{i}" for i in range(1000)]
    try:
        for subject in subjects:  # a plain flush lost a few of a thousand here
            await listener.subscribe(subject, cb=on_message)
            await subscribed(listener)
            await publisher.publish(subject, b"x")
        await publisher.flush()
        await eventually(lambda: len(received) == len(subjects), timeout_s=5)
    finally:
        await listener.close()
        await publisher.close()
