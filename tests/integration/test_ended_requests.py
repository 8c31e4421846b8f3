"""A request its gateway ended (the client left, a stop string) is let go everywhere, also
by a worker whose peer heard the end first. Before, when the decode worker dropped its
reservation on the gateway's abort before the prefill worker heard it, the prefill worker took
the refused commit for a failed handoff: it held the KV, asked a conductor for another decode
worker, and the conductor placed one (reserving blocks until its lease ran out, publishing a
`migrated` event for a request that was gone): 16 times in 96,000 requests of which one in
ten left after its first token (an ad hoc soak of `halfmoon up --engine fake`)."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from services.prefill.duty import LEASE_KINDS
from shared.errors import ErrorCode
from shared.messages import (
    AbortRequest,
    DecodeReplacement,
    DecodeReservation,
    DispatchReply,
    GatewayEvent,
    GenerateRequest,
    KvCommitted,
    PrefillTask,
    SamplingParams,
    TokenBatch,
)
from shared.nats_client import dispatch, encode, subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e


def request(reply_subject: str = "_INBOX.unused") -> GenerateRequest:
    return GenerateRequest(
        request_id="ended-1", model="halfmoon-tiny", prompt_token_ids=[1, 2, 3, 4],
        sampling=SamplingParams(max_tokens=8, temperature=0), reply_subject=reply_subject,
        created_at_s=0.0)


def ended(worker_id: str = "") -> AbortRequest:
    return AbortRequest(request_id="ended-1", reason="client gone", is_ended=True,
                        worker_id=worker_id)


async def test_commands_for_a_request_its_gateway_ended_are_refused_as_aborted(
        nats_url: str) -> None:
    async with Stack(nats_url) as stack:
        nc, prefill, decode = stack.gateway.nc, stack.prefills[0], stack.decodes[0]
        await nc.publish(decode.subjects.abort, encode(ended()))
        await eventually(lambda: decode.superseded.is_ended("ended-1")
                         and prefill.superseded.is_ended("ended-1"))
        replies: list[DispatchReply] = [
            await dispatch(nc, prefill.subjects.prefill_task(prefill.worker_id),
                           PrefillTask(request=request()), 5),
            await dispatch(nc, decode.subjects.decode_reserve(decode.worker_id),
                           DecodeReservation(request=request(),
                                             prefill_worker_id=prefill.worker_id), 5),
            await dispatch(nc, decode.subjects.kv_commit(decode.worker_id), KvCommitted(
                request_id="ended-1", prefill_worker_id=prefill.worker_id, first_token_id=5,
                num_prompt_tokens=4), 5)]
        assert [(r.is_accepted, r.code) for r in replies] == [(False, ErrorCode.ABORTED)] * 3
        assert replies[0].reason == "request ended-1 was ended by its gateway"
        assert prefill.duty.num_waiting() == 0 and decode.duty.num_waiting() == 0


async def test_a_prefill_worker_whose_commit_is_refused_as_ended_lets_the_request_go(
        nats_url: str) -> None:
    """The decode worker hears the end, the prefill worker not (yet): its commit is refused
    as aborted, and it neither asks for another decode worker nor fails the request."""
    async with Stack(nats_url, prefill_options={"fake_prefill_delay_s": 0.3}) as stack:
        prefill, decode = stack.prefills[0], stack.decodes[0]
        watcher = await nats.connect(nats_url)
        asked: list[bytes] = []
        answers: list[GatewayEvent] = []

        async def on_ask(msg: nats.aio.msg.Msg) -> None:
            asked.append(msg.data)

        async def on_answer(msg: nats.aio.msg.Msg) -> None:
            answers.append(msgspec.json.decode(msg.data, type=GatewayEvent))

        try:
            await watcher.subscribe(prefill.subjects.decode_replacement, cb=on_ask)
            await watcher.subscribe("ended.reply", cb=on_answer)
            await subscribed(watcher)
            nc, sent = stack.gateway.nc, request("ended.reply")
            assert (await dispatch(nc, decode.subjects.decode_reserve(decode.worker_id),
                                   DecodeReservation(request=sent,
                                                     prefill_worker_id=prefill.worker_id),
                                   5)).is_accepted
            assert (await dispatch(nc, prefill.subjects.prefill_task(prefill.worker_id),
                                   PrefillTask(request=sent), 5)).is_accepted
            await nc.publish(decode.subjects.abort, encode(ended(decode.worker_id)))
            await eventually(lambda: prefill.duty.num_waiting() == 0)
            await asyncio.sleep(0.2)  # what it would send after, delivered
            assert asked == []
            assert [type(answer) for answer in answers] == [TokenBatch]  # the first token
            assert prefill.leases.count(LEASE_KINDS) == 0
            assert decode.duty.num_open_requests == 0
        finally:
            await watcher.close()


async def test_a_conductor_places_no_decode_worker_for_a_request_its_gateway_ended(
        nats_url: str) -> None:
    async with Stack(nats_url) as stack:
        conductor, prefill = stack.conductor, stack.prefills[0]
        await stack.gateway.nc.publish(conductor.subjects.abort, encode(ended()))
        await eventually(lambda: "ended-1" in conductor.abandoned)
        reply = await dispatch(stack.gateway.nc, conductor.subjects.decode_replacement,
                               DecodeReplacement(request=request(),
                                                 prefill_worker_id=prefill.worker_id,
                                                 failed_decode_worker_id="decode-gone",
                                                 reason="commit refused"), 5)
        assert (reply.is_accepted, reply.code) == (False, ErrorCode.ABORTED)
        assert stack.decodes[0].duty.num_open_requests == 0



async def test_a_request_a_worker_knows_ended_is_dropped_by_the_conductor_that_places_it(
        nats_url: str) -> None:
    """The prefill worker heard the end, the conductor not: the task is refused as aborted,
    and the conductor drops the request (the decode side that took it let go) instead of
    trying other workers or telling the gateway it failed."""
    async with Stack(nats_url) as stack:
        prefill, decode, conductor = stack.prefills[0], stack.decodes[0], stack.conductor
        prefill.superseded.note(ended())  # as its abort subscription does
        watcher = await nats.connect(nats_url)
        answers: list[bytes] = []

        async def on_answer(msg: nats.aio.msg.Msg) -> None:
            answers.append(msg.data)

        def num_dropped() -> float:
            return conductor.metrics.registry.get_sample_value(
                "halfmoon_requests_abandoned_total") or 0.0

        try:
            await watcher.subscribe("ended.reply", cb=on_answer)
            await subscribed(watcher)
            dropped = num_dropped()
            await watcher.jetstream().publish(conductor.subjects.requests,
                                              encode(request("ended.reply")))
            await eventually(lambda: num_dropped() == dropped + 1)
            await eventually(lambda: decode.duty.num_open_requests == 0)
            await asyncio.sleep(0.2)
            assert answers == []
            assert conductor.rejections == {}
        finally:
            await watcher.close()
