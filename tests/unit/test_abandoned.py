"""Which aborts end a request for the conductors, what waits of it, and how many are
remembered."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter

from services.conductor.abandoned import Abandoned
from services.conductor.room_lines import RoomLines
from shared.messages import AbortRequest


def abandoned(lines: RoomLines | None = None, max_requests: int = 100) -> Abandoned:
    return Abandoned(lines or RoomLines(), Counter("dropped", "", registry=CollectorRegistry()),
                     max_requests)


async def test_only_an_abort_that_ends_the_request_is_remembered() -> None:
    ended = abandoned()
    await ended.on_abort(AbortRequest(request_id="a", reason="prefill failed"))
    await ended.on_abort(AbortRequest(request_id="b", attempt=2, before_delivery=1))
    await ended.on_abort(AbortRequest(request_id="c", is_ended=True))
    assert "c" in ended and "a" not in ended and "b" not in ended


async def test_the_oldest_ended_requests_are_forgotten_first() -> None:
    ended = abandoned(max_requests=2)
    for request_id in ("a", "b", "c"):
        await ended.on_abort(AbortRequest(request_id=request_id, is_ended=True))
    assert "a" not in ended and "b" in ended and "c" in ended


async def test_an_ended_request_waiting_in_line_gets_its_turn_at_once() -> None:
    """Not the head: it would otherwise wait for those ahead of it to be placed."""
    lines = RoomLines()
    head, behind = lines.join("m", "head"), lines.join("m", "behind")
    await abandoned(lines).on_abort(AbortRequest(request_id="behind", is_ended=True))
    await asyncio.wait_for(behind.turn.wait(), 1)
    assert not head.turn.is_set()
