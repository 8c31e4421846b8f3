"""Priority scheduling through the stack (`--scheduling-policy priority`): a more urgent
request goes first in every decode step it shares with less urgent ones, whether the decode
worker or a prefill worker computed its prompt, and its priority is on its public events;
a gateway that schedules first come, first served refuses a priority. (The engine's queue
and preemption: `tests/unit/test_scheduler.py`, `tests/engine/test_preemption.py`; the
conductor's lines: `tests/unit/test_room_lines.py`, `tests/integration/test_room_lines.py`.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from tests.integration.test_events import subscriber
from tests.stack import PATHS, Stack, eventually, torch_stack_on

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
NUM_LESS_URGENT = 4


async def finishing_order(stack: Stack, priority: int) -> list[str]:
    """Four requests that take turns in one-sequence decode steps, then one more with
    `priority` once they stream: which finished when."""
    order: list[str] = []

    async def run(name: str, prompt: str, max_tokens: int, priority: int = 0) -> None:
        status, body = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "priority": priority})
        assert status == 200, body
        order.append(name)

    started = [asyncio.create_task(run(f"n{i}", f"request number {i} says", 200))
               for i in range(NUM_LESS_URGENT)]
    await asyncio.sleep(0.3)  # placed, and taking turns (800 steps in all)
    await run("urgent", "an urgent request says", 200, priority)
    await asyncio.gather(*started)
    return order


@pytest.mark.parametrize("path", PATHS)
async def test_a_more_urgent_request_goes_first_in_each_step(
        nats_url: str, tiny_dir: Path, path: str) -> None:
    """One sequence per decode step: the less urgent take turns, the urgent one runs in
    every step from its arrival to its end (at one priority it would take its turn too)."""
    async with torch_stack_on(path, nats_url, str(tiny_dir), max_batch_size=1,
                              gateway={"scheduling_policy": "priority"}) as stack, \
            subscriber(stack) as events:
        order = await finishing_order(stack, priority=-1)
        await stack.wait_blocks_free()
        await eventually(lambda: sum(e.kind == "finished" for e in events) == len(order))
    assert order[0] == "urgent", order
    # Public events say each request's priority, for dashboards that split by it.
    priorities = {e.priority for e in events if e.kind in ("accepted", "finished")}
    assert priorities == {0, -1}
    assert sum(e.priority == -1 for e in events if e.kind in ("accepted", "finished")) == 2


async def test_a_first_come_first_served_gateway_refuses_a_priority(
        nats_url: str, tiny_dir: Path) -> None:
    async with torch_stack_on("disaggregated", nats_url, str(tiny_dir)) as stack, \
            aiohttp.ClientSession() as session:
        for priority, expected in ((0, 200), (3, 400)):
            async with session.post(f"{stack.gateway.url}/v1/completions", json={
                    "model": MODEL, "prompt": "hi", "max_tokens": 2,
                    "priority": priority}) as response:
                assert response.status == expected
                if expected == 400:
                    body = await response.json()
                    assert body["error"]["param"] == "priority"
                    assert "--scheduling-policy priority" in body["error"]["message"]
        async with session.post(f"{stack.gateway.url}/v1/responses", json={
                "model": MODEL, "input": "hi", "max_output_tokens": 2,
                "priority": 3}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "priority"


@pytest.mark.parametrize("path", PATHS)
async def test_a_more_urgent_request_takes_kv_from_less_urgent_running_ones(
        nats_url: str, tiny_dir: Path, path: str) -> None:
    """The decode pool nearly full of less urgent requests: a more urgent one is placed at
    once (the conductor counts their blocks as its room) and its reservation, or its
    prompt, preempts some of them; it finishes first, where it would wait for one of them
    to end, and every output is the one it gets alone."""
    prompts = [f"request number {i} says" for i in range(3)]
    urgent = " ".join(f"w{j % 50}" for j in range(240))  # ~30 blocks of KV
    async with torch_stack_on(path, nats_url, str(tiny_dir), num_blocks=96,
                              gateway={"scheduling_policy": "priority"}) as stack:
        async def run(prompt: str, max_tokens: int, priority: int = 0) -> str:
            status, body = await stack.post("/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "priority": priority})
            assert status == 200, body
            return str(body["choices"][0]["text"])

        alone = [await run(prompt, 500) for prompt in prompts] + [await run(urgent, 8)]
        decode = stack.decodes[0].engine
        preempted_before = decode.stats().num_preemptions
        order: list[int] = []

        async def timed(i: int, prompt: str, max_tokens: int, priority: int = 0) -> str:
            text = await run(prompt, max_tokens, priority)
            order.append(i)
            return text

        running = [asyncio.create_task(timed(i, p, 500)) for i, p in enumerate(prompts)]
        await eventually(lambda: decode.stats().num_free_blocks < 28, timeout_s=30)
        first = await timed(3, urgent, 8, priority=-1)
        assert [*await asyncio.gather(*running), first] == alone
        assert order[0] == 3, order
        assert decode.stats().num_preemptions > preempted_before
        await stack.wait_blocks_free()
