"""Requests that find no room (decode KV, a prefill queue place, a healthy worker of a
role) wait in line at the conductor: a burst larger than the pool is served, first come
first served (a more urgent request ahead), requests wait for a decode worker to come back,
and a conductor that stops hands its line back to the queue."""

from __future__ import annotations

import asyncio

import pytest

from services.conductor.service import ConductorService
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

# Each takes 7 of decode's 12 blocks (prompt + a block of output; one block is the growth
# watermark): one runs at a time, the others wait for its blocks.
BODY = {"model": "halfmoon-tiny", "prompt": "x" * 85, "max_tokens": 10}


SHORT = {"model": "halfmoon-tiny", "prompt": "short", "max_tokens": 3}  # decode prefills it


async def lose(stack: Stack, *roles: str) -> None:
    """Stop the stack's worker of each role; back once the conductor sees none healthy."""
    for role in roles:
        await (stack.prefills if role == "prefill" else stack.decodes)[0].stop()
    await eventually(lambda: not any(stack.conductor.workers.healthy(role) for role in roles),
                     timeout_s=5)


async def bring_back(stack: Stack, role: str) -> None:
    """A new worker of `role` in place of the stopped one, with its config."""
    workers = stack.prefills if role == "prefill" else stack.decodes
    workers[0] = type(workers[0])(workers[0].config)
    await workers[0].start()


def short_pool(nats_url: str) -> Stack:
    return Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                 decode_options={"num_blocks": 12})


async def test_a_burst_larger_than_the_kv_pool_is_served_in_arrival_order(
        nats_url: str) -> None:
    async with short_pool(nats_url) as stack:
        finished: list[int] = []

        async def ask(i: int) -> int:
            await asyncio.sleep(0.05 * i)  # into the queue in this order
            status, reply = await stack.post("/v1/completions", BODY)
            assert status == 200, reply
            finished.append(i)
            return int(reply["usage"]["completion_tokens"])

        assert await asyncio.gather(*(ask(i) for i in range(6))) == [10] * 6
        assert finished == list(range(6))
        # Waited in line, not sent back to the queue to be delivered again.
        registry = stack.conductor.metrics.registry
        assert (registry.get_sample_value("halfmoon_room_waits_total") or 0) >= 3
        assert registry.get_sample_value("halfmoon_request_deliveries_again_total",
                                         {"step": "held_here"}) is None
        assert len(stack.conductor.room_lines) == 0
        await stack.wait_blocks_free()


async def test_a_more_urgent_request_is_placed_ahead_of_those_waiting_longer(
        nats_url: str) -> None:
    """One request runs at a time in the short pool, the others wait in line; one more
    urgent (the gateway serving priorities) comes last and is placed before those that
    were still waiting (at least the last three: the first two may have run by then)."""
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                     decode_options={"num_blocks": 12},
                     gateway_options={"scheduling_policy": "priority"}) as stack:
        finished: list[str] = []

        async def ask(name: str, delay_s: float, priority: int = 0) -> None:
            await asyncio.sleep(delay_s)  # into the queue in this order
            status, reply = await stack.post("/v1/completions", {**BODY, "priority": priority})
            assert status == 200, reply
            finished.append(name)

        await asyncio.gather(*(ask(f"n{i}", 0.05 * i) for i in range(5)),
                             ask("urgent", 0.3, priority=-1))
        assert finished.index("urgent") < min(finished.index(f"n{i}") for i in (2, 3, 4)), \
            finished


async def test_a_stopping_conductor_hands_its_waiting_requests_to_the_next(
        nats_url: str) -> None:
    async with short_pool(nats_url) as stack:
        asks = [asyncio.create_task(stack.post("/v1/completions", {**BODY, "max_tokens": 40}))]
        await eventually(lambda: stack.decodes[0].engine.stats().num_running == 1)
        asks += [asyncio.create_task(stack.post("/v1/completions", BODY)) for _ in range(2)]
        await eventually(lambda: len(stack.conductor.room_lines) == 2)
        await stack.conductor.stop()
        assert len(stack.conductor.room_lines) == 0
        stack.conductor = ConductorService(stack.conductor.config)
        await stack.conductor.start()
        replies = await asyncio.wait_for(asyncio.gather(*asks), 20)
        assert [status for status, _ in replies] == [200] * 3, replies
        await stack.wait_blocks_free()


async def test_requests_past_a_full_prefill_queue_wait_for_it(nats_url: str) -> None:
    """The prefill worker queues one request at a time: the others wait in line, and none
    is told that no prefill worker is alive (before: a 503 once the no-worker hold ran out,
    here none at all)."""
    async with Stack(nats_url, worker={"fake_prefill_delay_s": 0.2},
                     prefill_options={"max_queue": 1},
                     conductor_options={"no_worker_hold_s": 0.0}) as stack:
        body = {"model": "halfmoon-tiny", "prompt": "x" * 40, "max_tokens": 4}
        replies = await asyncio.gather(*(stack.post("/v1/completions", body)
                                         for _ in range(5)))
        assert [status for status, _ in replies] == [200] * 5, [r.get("error") for _, r in replies]
        assert stack.conductor.metrics.registry.get_sample_value("halfmoon_room_waits_total")
        await stack.wait_blocks_free()


async def test_requests_wait_in_line_for_a_decode_worker_to_come_back(nats_url: str) -> None:
    """The only decode worker gone for a while (restarting, stalled): the requests wait in
    their first delivery and go at its first heartbeat. Before, each went back to the queue
    to be delivered again a fixed time later, and was refused after 5 s."""
    async with Stack(nats_url) as stack:
        await lose(stack, "decode")
        asks = [asyncio.create_task(stack.post("/v1/completions", {**BODY, "max_tokens": 3}))
                for _ in range(3)]
        await eventually(lambda: len(stack.conductor.room_lines) == 3)
        await asyncio.sleep(0.5)
        await bring_back(stack, "decode")
        replies = await asyncio.wait_for(asyncio.gather(*asks), 10)
        assert [status for status, _ in replies] == [200] * 3, replies
        registry = stack.conductor.metrics.registry
        assert registry.get_sample_value("halfmoon_room_waits_total") == 3
        # Their placement took the wait in line too, not only the try that placed them.
        assert registry.get_sample_value("halfmoon_placement_seconds_count") == 3
        assert registry.get_sample_value("halfmoon_placement_seconds_sum") >= 3 * 0.5
        assert registry.get_sample_value("halfmoon_request_deliveries_again_total",
                                         {"step": "held_here"}) is None
        await stack.wait_blocks_free()


async def test_a_request_that_needs_no_missing_worker_is_placed_past_those_waiting_for_one(
        nats_url: str) -> None:
    """The prefill worker gone, a long prompt waits for it; a short one that the decode
    worker prefills itself (`local_prefill_max_tokens`) is served meanwhile, not queued
    behind it: waiting for a worker is a line of its own, which newcomers try past."""
    async with Stack(nats_url, decode_options={"local_prefill_max_tokens": 16}) as stack:
        await lose(stack, "prefill")
        long = asyncio.create_task(stack.post("/v1/completions", {**BODY, "max_tokens": 3}))
        await eventually(lambda: len(stack.conductor.room_lines) == 1)
        status, reply = await asyncio.wait_for(stack.post("/v1/completions", SHORT), 5)
        assert status == 200, reply
        assert not long.done()
        await bring_back(stack, "prefill")
        status, reply = await asyncio.wait_for(long, 10)
        assert status == 200, reply
        await stack.wait_blocks_free()


async def test_with_both_roles_gone_a_request_needing_only_the_one_back_is_not_held_up(
        nats_url: str) -> None:
    """Prefill and decode workers both gone: a long prompt, then a short one the decode
    worker prefills itself, wait for a decode worker. Decode comes back first: the long
    prompt, now waiting for a prefill worker, goes to that role's line, and the short one
    is served at once instead of behind it (one line for every missing worker held it until
    prefill came back, or the long one's 30 s hold ran out)."""
    async with Stack(nats_url, decode_options={"local_prefill_max_tokens": 16}) as stack:
        await lose(stack, "prefill", "decode")
        long = asyncio.create_task(stack.post("/v1/completions", {**BODY, "max_tokens": 3}))
        await eventually(lambda: len(stack.conductor.room_lines) == 1)
        short = asyncio.create_task(stack.post("/v1/completions", SHORT))
        await eventually(lambda: len(stack.conductor.room_lines) == 2)
        await bring_back(stack, "decode")
        status, reply = await asyncio.wait_for(short, 5)
        assert status == 200, reply
        assert not long.done()
        await bring_back(stack, "prefill")
        status, reply = await asyncio.wait_for(long, 10)
        assert status == 200, reply
        await stack.wait_blocks_free()
