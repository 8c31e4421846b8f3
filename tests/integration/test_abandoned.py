"""A request whose client leaves before it is placed is dropped by the conductor, not
computed for no one: while it waits in line for room, or when pulled from the queue after
its gateway ended it; and a conductor that starts after the client left (it heard no abort)
never finds it: the gateway took it out of the queue."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import msgspec
import nats
import pytest
from nats.aio.msg import Msg

from services.conductor.intake import InHand
from services.conductor.service import ConductorService
from shared.messages import GenerateRequest, RequestEvent
from shared.nats_client import subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

# Each takes 7 of decode's 12 blocks: while one runs, the next waits in line for room.
BODY = {"model": "halfmoon-tiny", "prompt": "x" * 85, "max_tokens": 10}


@asynccontextmanager
async def placed_events(stack: Stack) -> AsyncIterator[list[str]]:
    """The ids of the requests the conductor placed, from its public `placed` events."""
    nc = await nats.connect(stack.nats_url)
    placed: list[str] = []
    decoder = msgspec.json.Decoder(RequestEvent)

    async def on_event(msg: Msg) -> None:
        placed.append(decoder.decode(msg.data).request_id)

    await nc.subscribe(stack.gateway.subjects.request_event("placed"), cb=on_event)
    await subscribed(nc)
    try:
        yield placed
    finally:
        await nc.close()


async def leave_after(stack: Stack, timeout_s: float) -> None:
    """A completion whose client gives up after `timeout_s`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        with pytest.raises(asyncio.TimeoutError):
            await session.post(f"{stack.base_url}/completions", json=BODY)


def num_abandoned(stack: Stack) -> float:
    return stack.conductor.metrics.registry.get_sample_value(
        "halfmoon_requests_abandoned_total") or 0


async def test_a_request_whose_client_left_while_it_waited_for_room_is_not_placed(
        nats_url: str) -> None:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                     decode_options={"num_blocks": 12}) as stack, \
            placed_events(stack) as placed:
        running = asyncio.create_task(stack.post("/v1/completions",
                                                 {**BODY, "max_tokens": 100}))
        await eventually(lambda: stack.decodes[0].engine.stats().num_running == 1)
        await leave_after(stack, 0.5)  # in line behind the running one all along
        await eventually(lambda: num_abandoned(stack) == 1)
        assert len(stack.conductor.room_lines) == 0  # out of the line before room freed
        status, reply = await running
        assert status == 200, reply
        await stack.wait_blocks_free()
        await asyncio.sleep(0.5)  # heartbeats that would have let a waiter go
        assert placed == [reply["id"]]


async def test_a_request_its_gateway_ended_before_it_was_pulled_is_not_placed(
        nats_url: str) -> None:
    """The conductor pulls the request only once its client has left (a backlog)."""
    stack = Stack(nats_url)
    conductor, handle = stack.conductor, stack.conductor._handle
    decoder = msgspec.json.Decoder(GenerateRequest)

    async def handle_once_ended(msg: Msg, in_hand: InHand) -> None:
        request_id = decoder.decode(msg.data).request_id
        await eventually(lambda: request_id in conductor.abandoned)
        await handle(msg, in_hand)

    conductor._handle = handle_once_ended  # type: ignore[method-assign]
    async with stack, placed_events(stack) as placed:
        await leave_after(stack, 0.5)
        await eventually(lambda: num_abandoned(stack) == 1)
        await asyncio.sleep(0.3)
        assert placed == []
        assert stack.num_free_decode_blocks() == stack.decodes[0].engine.stats().num_total_blocks


async def test_a_request_its_client_left_while_no_conductor_ran_is_never_placed(
        nats_url: str) -> None:
    """Its abort reached no conductor. Before, the conductor that started next placed it,
    and after an outage such a backlog was computed ahead of the requests still waited for."""
    async with Stack(nats_url) as stack, placed_events(stack) as placed:
        await stack.conductor.stop()
        await leave_after(stack, 0.5)
        await eventually(lambda: len(stack.gateway.table) == 0)  # its end has run
        info = await stack.gateway.nc.jetstream().stream_info(
            stack.gateway.subjects.requests_stream)
        assert info.state.messages == 0
        stack.conductor = ConductorService(stack.conductor.config)
        await stack.conductor.start()
        await stack.wait_healthy()
        status, reply = await stack.post("/v1/completions", BODY)
        assert status == 200, reply
        assert placed == [reply["id"]]
        assert num_abandoned(stack) == 0  # nothing left to pull and drop
