"""A decode worker lets go of requests no client waits for any more: one whose abort was
lost, and every request of a gateway that died. Before, each was decoded to its last token
for no one (here: 500 tokens, 10 s of a batch slot and its blocks)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from services.decode import orphans
from services.gateway.service import GatewayService
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

LONG = {"model": "halfmoon-tiny", "prompt": "for no one", "max_tokens": 500, "stream": True,
        "temperature": 0.0}  # 10 s at 20 ms a token


@pytest.fixture(autouse=True)
def check_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(orphans, "CHECK_EVERY_S", 0.3)


@pytest.fixture
async def stack(nats_url: str) -> AsyncIterator[Stack]:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.02}) as running:
        yield running


async def first_chunk_then_leave(url: str) -> None:
    """A streaming client that reads its first chunk and hangs up."""
    async with aiohttp.ClientSession() as session, \
            session.post(f"{url}/v1/completions", json=LONG) as response:
        assert response.status == 200
        await response.content.readline()


def orphaned(stack: Stack) -> float | None:
    return stack.decodes[0].metrics.registry.get_sample_value(
        "halfmoon_orphaned_streams_total")


async def test_a_request_whose_abort_was_lost_is_let_go(stack: Stack) -> None:
    async def lose(request_id: str) -> None:
        return None  # the client left, and the gateway's abort never reached the worker

    stack.gateway._generator._abort = lose  # type: ignore[method-assign]
    decode = stack.decodes[0]
    await first_chunk_then_leave(stack.gateway.url)
    await eventually(lambda: len(stack.gateway.table) == 0)
    assert decode.engine.stats().num_running == 1  # decoding on, for no one
    await eventually(lambda: decode.engine.stats().num_running == 0, timeout_s=3.0)
    assert orphaned(stack) == 1
    await stack.wait_blocks_free()


async def test_the_requests_of_a_gateway_that_died_are_let_go(stack: Stack) -> None:
    doomed = GatewayService(msgspec.structs.replace(stack.gateway.config, gateway_id=""))
    await doomed.start()
    decode = stack.decodes[0]
    clients = [asyncio.create_task(first_chunk_then_leave_open(doomed.url)) for _ in range(2)]
    try:
        await eventually(lambda: decode.engine.stats().num_running == 2)
        await doomed._cancel_tasks()  # the process dies: nothing answers on its subjects
        await doomed.nc.close()
        # Two checks with no one listening (a NATS route may drop interest for a moment).
        await eventually(lambda: decode.engine.stats().num_running == 0, timeout_s=3.0)
    finally:
        for client in clients:
            client.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
    assert orphaned(stack) == 2
    await stack.wait_blocks_free()
    # The stack's own gateway, alive, keeps its request (1.2 s: checked four times).
    status, body = await stack.post("/v1/completions", {**LONG, "max_tokens": 60,
                                                        "stream": False})
    assert status == 200, body
    assert orphaned(stack) == 2


async def first_chunk_then_leave_open(url: str) -> None:
    """A streaming client that reads its first chunk and then waits (until cancelled)."""
    async with aiohttp.ClientSession() as session, \
            session.post(f"{url}/v1/completions", json=LONG) as response:
        await response.content.readline()
        with contextlib.suppress(aiohttp.ClientError):
            await asyncio.sleep(60)
