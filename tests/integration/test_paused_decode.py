"""A decode worker that freezes mid-handoff (a SIGSTOPped process: no heartbeat, no answer)
and comes back. The gateway places the rest of its request again; the prefill worker still
holds the first attempt, waiting to commit it there. Before, it took the second attempt for
a redelivery of the first and dropped it: the new decode worker waited for KV that never
came until its reservation expired, and the client got an error (`bench.chaos`'s
`pause-decode`: 2-3 of 48 requests in one run of three)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from services.decode.duty import DecodeDuty
from services.worker import DecodeService
from shared.messages import (
    AbortRequest,
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    KvCommitted,
    KvTarget,
    PrefillTask,
    SamplingParams,
)
from shared.nats_client import dispatch, encode
from tests.integration.test_events import subscriber
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

BODY: dict[str, Any] = {"model": "halfmoon-tiny", "prompt": "frozen for a while",
                        "max_tokens": 30, "temperature": 0, "ignore_eos": True}


class FreezingDecodeDuty(DecodeDuty):
    """Freezes at its first commit until resumed."""

    async def _on_commit(self, message: KvCommitted) -> DispatchReply:
        worker: FreezingDecode = self.worker  # type: ignore[assignment]
        worker.is_frozen = True
        await worker.resumed.wait()
        return await super()._on_commit(message)


class FreezingDecode(DecodeService):
    duty_types = {**DecodeService.duty_types, "decode": FreezingDecodeDuty}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.is_frozen = False
        self.resumed = asyncio.Event()
        send = self.heartbeats.send

        async def send_unless_frozen(*, is_registered: bool = True) -> None:
            if self.is_frozen:
                await self.resumed.wait()
            await send(is_registered=is_registered)

        self.heartbeats.send = send_unless_frozen  # type: ignore[method-assign]


async def test_a_request_whose_decode_worker_froze_mid_handoff_completes_elsewhere(
        nats_url: str) -> None:
    stack = Stack(nats_url, num_decode=2, worker={"fake_token_delay_s": 0.01})
    # Its id sorts first: placement tries it first (all else equal).
    stack.decodes[0] = frozen = FreezingDecode(msgspec.structs.replace(
        stack.decodes[0].config, worker_id="decode-0-freezes"))
    async with stack, subscriber(stack) as events:
        other = stack.decodes[1]
        status, body = await stack.post("/v1/completions", BODY)
        assert status == 200, body
        assert frozen.is_frozen  # the request met the frozen worker, and moved on
        frozen.resumed.set()
        (migrated,) = [e for e in events if e.kind == "migrated" and e.attempt]  # the gateway's
        assert migrated.lost_worker_id == frozen.worker_id
        await eventually(lambda: frozen.engine.stats().num_running == 0)
        status, again = await stack.post("/v1/completions", BODY)  # now on the healthy worker
        assert status == 200, again
        assert body["choices"][0]["text"] == again["choices"][0]["text"]
        assert other.engine.stats().num_running == 0
        await stack.wait_blocks_free(timeout_s=10)


def attempt(number: int) -> GenerateRequest:
    """Attempt `number` of one request: its prompt grows by a token streamed before each."""
    return GenerateRequest(
        request_id="r1", model="halfmoon-tiny", prompt_token_ids=list(range(4 + number)),
        sampling=SamplingParams(max_tokens=8, temperature=0), reply_subject="_INBOX.unused",
        created_at_s=0.0, attempt=number, output_offset=number)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_worker_runs_one_attempt_of_a_request_at_a_time(nats_url: str,
                                                                 role: str) -> None:
    """Were the gateway's abort of the attempt before lost, the next attempt is refused
    (placed elsewhere, or held) while the earlier one runs here, never taken for a
    redelivery of it: their prompts, and so their KV, differ by the tokens streamed between."""
    async with Stack(nats_url) as stack:  # its other side never hears of the request
        worker = stack.prefills[0] if role == "prefill" else stack.decodes[0]

        async def send(number: int) -> DispatchReply:
            if role == "prefill":
                subject, command = (worker.subjects.prefill_task(worker.worker_id),
                                    PrefillTask(request=attempt(number)))
            else:
                subject, command = (worker.subjects.decode_reserve(worker.worker_id),
                                    DecodeReservation(request=attempt(number),
                                                      prefill_worker_id="p1"))
            return await dispatch(stack.gateway.nc, subject, command, 5)

        assert (await send(0)).is_accepted  # waits for its other side: none comes
        assert (await send(0)).is_accepted  # a redelivery: the same run
        refused = await send(1)
        assert not refused.is_accepted and "attempt 0" in refused.reason
        worker.duty.abort("r1")
        assert (await send(1)).is_accepted  # once the earlier one is gone
        worker.duty.abort("r1")


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_worker_refuses_a_command_from_before_its_request_was_placed_again(
        nats_url: str, role: str) -> None:
    """An abort that places a request again names where from: a conductor's, the delivery
    it places (a command of an earlier one, from a conductor that stood still, may still be
    on its way); a gateway's, the next attempt. A command from before that is refused."""
    async with Stack(nats_url) as stack:
        worker = stack.prefills[0] if role == "prefill" else stack.decodes[0]
        nc = stack.gateway.nc

        async def send(number: int, delivery: int) -> DispatchReply:
            request = attempt(number)
            if role == "prefill":
                subject, command = (worker.subjects.prefill_task(worker.worker_id),
                                    PrefillTask(request=request, delivery=delivery))
            else:
                subject, command = (worker.subjects.decode_reserve(worker.worker_id),
                                    DecodeReservation(request=request, prefill_worker_id="p1",
                                                      delivery=delivery))
            return await dispatch(nc, subject, command, 5)

        async def abort(number: int, before_delivery: int) -> None:
            await nc.publish(worker.subjects.abort, encode(AbortRequest(
                request_id="r1", attempt=number, before_delivery=before_delivery)))
            # Heard once the command just before it is refused.
            just_before = (number, before_delivery - 1) if before_delivery > 1 \
                else (number - 1, 1000)
            await eventually(lambda: worker.superseded.refusal(
                attempt(just_before[0]), just_before[1]) is not None)

        await abort(0, before_delivery=3)  # a conductor places delivery 3
        refused = await send(0, delivery=2)
        assert not refused.is_accepted
        assert refused.reason == ("delivery 2 of attempt 0 was placed again (from delivery 3 "
                                  "of attempt 0)")
        assert (await send(0, delivery=3)).is_accepted
        await abort(1, before_delivery=1)  # its gateway places attempt 1
        assert not (await send(0, delivery=4)).is_accepted
        assert (await send(1, delivery=1)).is_accepted
        assert (await send(1, delivery=0)).is_accepted  # names none: a decode side replaced
        worker.duty.abort("r1")


async def test_a_prefill_run_placed_again_right_after_its_abort_keeps_what_it_holds(
        nats_url: str) -> None:
    """The next delivery's abort and its `PrefillTask` reach the worker together. The
    aborted run ends a loop turn later; it used to clear the request's entry, KV target and
    engine state on its way out, the new run's by then: that run never handed off, and the
    decode worker's reservation for it ran out (`bench.chaos --launch processes --scenarios
    pause-conductor`: a 504 in 2 of 11 runs)."""
    async with Stack(nats_url, prefill_options={"fake_prefill_delay_s": 0.5}) as stack:
        duty = stack.prefills[0].duty
        assert (await duty._on_task(PrefillTask(request=attempt(0), delivery=1))).is_accepted
        await asyncio.sleep(0.1)  # computing
        duty.abort("r1")
        assert (await duty._on_task(PrefillTask(request=attempt(0), delivery=2))).is_accepted
        await asyncio.sleep(0.1)  # the aborted run has ended
        assert duty.num_waiting() == 1  # the new one runs on, still waiting for its target
        duty.abort("r1")


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_an_abort_that_comes_after_the_placement_it_makes_way_for_leaves_it(
        nats_url: str, role: str) -> None:
    """The abort that places a request again and the new placement's command come from
    different senders (and subscriptions): a worker may take the command first. The
    command replaces the earlier delivery's run itself, and the abort then passes the new
    one over (before, it stopped it: its decode worker waited for KV until its reservation
    ran out, a 504 in `bench.chaos --launch processes --scenarios pause-conductor`, caught
    in the workers' debug logs)."""
    async with Stack(nats_url, prefill_options={"fake_prefill_delay_s": 0.5}) as stack:
        worker = stack.prefills[0] if role == "prefill" else stack.decodes[0]
        nc = stack.gateway.nc

        async def send(delivery: int) -> DispatchReply:
            if role == "prefill":
                subject, command = (worker.subjects.prefill_task(worker.worker_id),
                                    PrefillTask(request=attempt(0), delivery=delivery))
            else:
                subject, command = (worker.subjects.decode_reserve(worker.worker_id),
                                    DecodeReservation(request=attempt(0), prefill_worker_id="p1",
                                                      delivery=delivery))
            return await dispatch(nc, subject, command, 5)

        assert (await send(1)).is_accepted
        assert (await send(2)).is_accepted  # before the abort that makes way for it
        await nc.publish(worker.subjects.abort, encode(AbortRequest(
            request_id="r1", attempt=0, before_delivery=2)))
        await eventually(lambda: worker.superseded.refusal(attempt(0), 1) is not None)
        assert worker.duty.num_waiting() == 1  # delivery 2's, still here
        worker.duty.abort("r1")


async def test_a_kv_target_of_the_placement_an_abort_makes_way_for_outlives_the_abort(
        nats_url: str) -> None:
    """The new placement's decode worker sent its target before the abort reached the
    prefill worker (whose task for that placement is still on its way): the abort stops
    the earlier run and keeps the target the new run will write to."""
    async with Stack(nats_url, prefill_options={"fake_prefill_delay_s": 0.5}) as stack:
        duty = stack.prefills[0].duty
        assert (await duty._on_task(PrefillTask(request=attempt(0), delivery=1))).is_accepted
        await duty._on_target(KvTarget(request_id="r1", decode_worker_id="d2", block_ids=[1],
                                       attempt=0, delivery=2))
        duty.abort("r1", placed_from=(0, 2))
        assert duty.num_waiting() == 0  # the earlier run stopped
        target = duty._targets.future("r1")
        assert target.done() and target.result().decode_worker_id == "d2"
        duty.abort("r1")  # a plain abort drops it
        assert not duty._targets.future("r1").done()
        duty.abort("r1")
