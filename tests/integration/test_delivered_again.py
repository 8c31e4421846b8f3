"""A request JetStream delivers to the conductors again after it was placed (its ack, or
its ack and its `RequestPlaced`, lost on the way: a conductor cut off or killed right after
sending the commands) runs once: the conductor asks the gateway before placing it again.
Before, it was placed a second time and two decode workers streamed it."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import nats
import openai
import pytest
from nats.aio.msg import Msg

from engine.fake_engine import fake_completion
from services.conductor import intake
from services.conductor.intake import InHand
from services.gateway.tokenizer import ByteTokenizer
from shared.errors import WorkerUnavailable
from shared.messages import (
    DecodeReservation,
    GatewayEvent,
    RequestEvent,
    RequestPlaced,
    TokenBatch,
)
from shared.nats_client import subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
PROMPT = "delivered again"
NUM_TOKENS = 120  # 2.4 s of decoding at 20 ms a token: still running when delivered again


@pytest.fixture(autouse=True)
def short_ack_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(intake, "ACK_WAIT_S", 1.0)
    monkeypatch.setattr(intake, "IN_PROGRESS_EVERY_S", 0.25)


def two_of_each(nats_url: str) -> Stack:
    return Stack(nats_url, num_prefill=2, num_decode=2, worker={"fake_token_delay_s": 0.02})


def lose_the_first_ack(stack: Stack) -> None:
    """The first delivery's ack never reaches JetStream (before the conductor starts)."""
    handle, lost = stack.conductor._handle, []

    async def handle_losing_ack(msg: Msg, in_hand: InHand) -> None:
        if not lost:
            lost.append(msg)

            async def nothing(*_: Any, **__: Any) -> None:
                return None

            msg.ack = nothing  # type: ignore[method-assign]
        await handle(msg, in_hand)

    stack.conductor._handle = handle_losing_ack  # type: ignore[method-assign]


@asynccontextmanager
async def tap(stack: Stack) -> AsyncIterator[tuple[Counter[str], Counter[str], Counter[str]]]:
    """Tokens each worker sent the gateway, the request events by kind, and the first
    tokens prefill workers sent for each request."""
    nc = await nats.connect(stack.nats_url)
    tokens: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    firsts: Counter[str] = Counter()
    events = msgspec.json.Decoder(GatewayEvent)
    lifecycle = msgspec.json.Decoder(RequestEvent)

    async def on_event(msg: Msg) -> None:
        if isinstance(event := events.decode(msg.data), TokenBatch):
            tokens[event.worker_id] += sum(len(item.token_ids) for item in event.items)
            if event.worker_id.startswith("prefill"):
                firsts.update(item.request_id for item in event.items)

    async def on_lifecycle(msg: Msg) -> None:
        kinds[lifecycle.decode(msg.data).kind] += 1

    await nc.subscribe(stack.gateway.subjects.gateway(stack.gateway.gateway_id), cb=on_event)
    await nc.subscribe(stack.gateway.subjects.all_request_events, cb=on_lifecycle)
    await subscribed(nc)
    try:
        yield tokens, kinds, firsts
    finally:
        await nc.close()


async def ask(stack: Stack) -> str:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0,
                                  timeout=30) as sdk:
        response = await sdk.completions.create(model=MODEL, prompt=PROMPT,
                                                max_tokens=NUM_TOKENS, temperature=0.0)
    assert response.usage is not None
    assert response.usage.completion_tokens == NUM_TOKENS
    return response.choices[0].text


def whole_answer() -> str:
    tokenizer = ByteTokenizer()
    return tokenizer.decode(fake_completion(tokenizer.encode(PROMPT), None, NUM_TOKENS))


def delivered_again(stack: Stack, step: str) -> float | None:
    return stack.conductor.metrics.registry.get_sample_value(
        "halfmoon_request_deliveries_again_total", {"step": step})


def intake_of(stack: Stack) -> intake.RequestIntake:
    assert stack.conductor.intake is not None
    return stack.conductor.intake


def decoded(tokens: Counter[str]) -> dict[str, int]:
    return {worker: count for worker, count in tokens.items() if worker.startswith("decode")}


async def test_a_placed_request_whose_ack_was_lost_is_not_placed_again(nats_url: str) -> None:
    stack = two_of_each(nats_url)
    lose_the_first_ack(stack)
    async with stack, tap(stack) as (tokens, kinds, _):
        assert await ask(stack) == whole_answer()
        await eventually(lambda: kinds["finished"] == 1)
        assert delivered_again(stack, "done") == 1
    # One decode worker streamed it (before: both, the whole answer each; placed twice).
    assert list(decoded(tokens).values()) == [NUM_TOKENS - 1]  # prefill sent the first
    assert kinds["placed"] == 1
    assert kinds["kv_committed"] == 1


async def test_a_request_streaming_from_a_placement_never_announced_moves_once(
        nats_url: str) -> None:
    """The ack and the `RequestPlaced` both lost: the gateway has tokens from workers it
    was never told of. The conductor aborts them and the gateway places the rest as a
    continuation: the whole answer, decoded about once (before: twice)."""
    stack = two_of_each(nats_url)
    lose_the_first_ack(stack)
    on_event, dropped = stack.gateway._on_event, []

    async def lose_the_first_placement(event: GatewayEvent) -> None:
        if isinstance(event, RequestPlaced) and not dropped:
            dropped.append(event)
            return
        await on_event(event)

    stack.gateway._on_event = lose_the_first_placement  # type: ignore[method-assign]
    async with stack, tap(stack) as (tokens, kinds, _):
        assert await ask(stack) == whole_answer()
        await eventually(lambda: kinds["finished"] == 1)
        assert delivered_again(stack, "move") == 1
    assert kinds["migrated"] == 1
    assert kinds["placed"] == 2  # the lost one, and the continuation's
    # The aborted run stopped: a token or two in flight at most came twice.
    assert sum(decoded(tokens).values()) <= NUM_TOKENS + 2


async def test_a_conductor_that_stood_still_past_the_ack_wait_sends_nothing_more(
        nats_url: str) -> None:
    """Its loop stood still mid-placement (a SIGSTOPped process): the delivery may be
    another conductor's now, which asks the gateway and places the request. The one that
    stood still sends none of its commands, no `RequestPlaced`, and neither acks nor naks
    (before, it went on: with two conductors, `bench.chaos --launch processes --scenarios
    pause-conductor` had a request placed twice in one of two runs)."""
    stack = two_of_each(nats_url)
    view, stood = stack.conductor.placer.view, []

    def stand_still_once(model: str) -> Any:
        if not stood:
            stood.append(model)
            time.sleep(intake.ACK_WAIT_S * 1.2)  # the whole loop stands still
        return view(model)

    stack.conductor.placer.view = stand_still_once  # type: ignore[method-assign]
    async with stack, tap(stack) as (tokens, kinds, _):
        assert await ask(stack) == whole_answer()
        await eventually(lambda: kinds["finished"] == 1)
        lapsed = stack.conductor.metrics.registry.get_sample_value(
            "halfmoon_request_deliveries_lapsed_total")
        assert lapsed == 1 and delivered_again(stack, "place") == 1
    assert kinds["placed"] == 1 and kinds["kv_committed"] == 1
    assert list(decoded(tokens).values()) == [NUM_TOKENS - 1]


async def test_commands_sent_before_their_conductor_stood_still_are_refused_once_placed_again(
        nats_url: str) -> None:
    """The conductor stood still with a delivery's commands not yet sent (in its client's
    buffer), and they leave only after the request's next delivery was placed, behind the
    abort that named it. Each is refused where it lands, and one decode worker streams the
    request (before, a worker took such a command for a new run, or re-pointed the new
    placement's reservation to the old prefill worker: `bench.chaos --launch processes
    --scenarios pause-conductor` had two requests time out in one run of eleven)."""
    stack = two_of_each(nats_url)
    dispatch, late = stack.conductor.placer.dispatch, []  # None, then the replies

    async def send_late(subject: str, command: Any, headers: dict[str, str]) -> Any:
        if command.delivery == 1:
            if not late:
                late.append(None)
                time.sleep(intake.ACK_WAIT_S * 1.2)  # noqa: ASYNC251 (the process stands still)
            await eventually(lambda: delivered_again(stack, "place") == 1
                             and intake_of(stack).num_in_hand == 1)  # the next delivery placed
            late.append(reply := await dispatch(subject, command, headers))
            return reply
        return await dispatch(subject, command, headers)

    stack.conductor.placer.dispatch = send_late  # type: ignore[method-assign]
    async with stack, tap(stack) as (tokens, kinds, _):
        assert await ask(stack) == whole_answer()
        await eventually(lambda: kinds["finished"] == 1 and len(late) == 3)
        assert delivered_again(stack, "place") == 1
    replies = late[1:]
    assert [reply.is_accepted for reply in replies] == [False, False]
    assert all("was placed again" in reply.reason for reply in replies), replies
    assert kinds["placed"] == 1 and kinds["kv_committed"] == 1
    assert list(decoded(tokens).values()) == [NUM_TOKENS - 1]


async def test_a_conductor_that_woke_to_overdue_replies_aborts_nothing(nats_url: str) -> None:
    """Its commands went out and were accepted, then it stood still: on waking, its replies'
    timeouts run first, so it takes those sides for silent and gives them up. It aborts
    neither: the request is another delivery's by then, which runs on the same workers
    (one prefill and one decode worker). Before, its abort stopped that run, and the client
    got a 504 once the decode worker's wait for KV ran out (`bench.chaos --launch processes
    --scenarios pause-conductor`: 1 request in 1 run of 5)."""
    stack = Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                  decode_options={"kv_wait_timeout_s": 3.0})
    dispatch, overdue = stack.conductor.placer.dispatch, []

    def placed_again() -> bool:  # its next delivery, or the continuation that moved it
        return sum(sample.value for metric in stack.conductor.metrics.placements.collect()
                   for sample in metric.samples if sample.name.endswith("_total")) >= 1

    async def overdue_replies(subject: str, command: Any, headers: dict[str, str]) -> Any:
        reply = await dispatch(subject, command, headers)
        if (command.request.attempt, command.delivery) == (0, 1):
            if not overdue:
                time.sleep(intake.ACK_WAIT_S * 1.2)  # noqa: ASYNC251 (the process stands still)
            overdue.append(reply)
            await eventually(placed_again)
            return WorkerUnavailable(f"no reply on {subject} in time")
        return reply

    stack.conductor.placer.dispatch = overdue_replies  # type: ignore[method-assign]
    async with stack, tap(stack) as (_, kinds, _):
        assert await ask(stack) == whole_answer()
        await eventually(lambda: kinds["finished"] == 1)
        await stack.wait_blocks_free(timeout_s=5)
    assert [reply.is_accepted for reply in overdue] == [True, True]
    assert kinds["failed"] == 0, kinds


async def test_a_held_request_has_its_first_token_from_one_prefill_run(nats_url: str) -> None:
    """Decode refuses for want of KV blocks while prefill computes: prefill is told to drop
    the request, which waits for KV at the conductor (it was held for a later delivery).
    Prefill sends an unseeded sampled first token only once decode has accepted, so the
    client's comes from the run that is placed for good (before, the refused run's reached
    the gateway too, which kept it: the client got its first token from one run and the
    rest from another)."""
    stack = Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                  decode_options={"num_blocks": 12},  # room for one request at a time
                  conductor_options={"kv_short_hold_s": 6.0, "no_worker_hold_s": 0.0})
    body = {"model": MODEL, "prompt": "x" * 85, "max_tokens": 20, "temperature": 0.8}
    async with stack, tap(stack) as (_, kinds, firsts):
        replies = await asyncio.gather(*(stack.post("/v1/completions", body)
                                         for _ in range(3)))
        assert [status for status, _ in replies] == [200] * 3, replies
        await eventually(lambda: kinds["finished"] == 3)
        waited = stack.conductor.metrics.registry.get_sample_value("halfmoon_room_waits_total")
        assert delivered_again(stack, "held_here") or waited  # some were held
    assert sorted(firsts.values()) == [1, 1, 1]


async def test_a_worker_given_up_in_a_delivery_leaves_the_request_to_the_next_one(
        nats_url: str) -> None:
    """A decode reservation unanswered in time is given up: its worker is told to refuse
    the rest of that delivery. With no other decode worker the request does not wait in
    line in that delivery, where every try would be refused until its 503 (seen as a planner
    test's 503 after the whole hold, its decode worker's reply late while it changed role),
    but comes again in the next delivery, and is served there."""
    stack = Stack(nats_url, worker={"fake_token_delay_s": 0.02},
                  conductor_options={"no_worker_hold_s": 10.0})
    dispatch, unanswered = stack.conductor.placer.dispatch, []

    async def first_unanswered(subject: str, command: Any, headers: dict[str, str]) -> Any:
        if isinstance(command, DecodeReservation) and not unanswered:
            unanswered.append(subject)  # sent, say, but its reply never came
            await dispatch(subject, command, headers)
            return WorkerUnavailable(f"no reply on {subject} in time")
        return await dispatch(subject, command, headers)

    stack.conductor.placer.dispatch = first_unanswered  # type: ignore[method-assign]
    async with stack:
        assert await asyncio.wait_for(ask(stack), 8) == whole_answer()
        assert delivered_again(stack, "held_here") == 1
        await stack.wait_blocks_free(timeout_s=5)
