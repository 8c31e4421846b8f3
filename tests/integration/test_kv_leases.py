"""Reservations are leases renewed while the prompt waits at prefill: long queues do not
expire them, and every grant and release is a public event."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats
import pytest

from shared.messages import KvLeaseEvent
from shared.nats_client import subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"


async def test_a_prompt_queued_longer_than_the_kv_timeout_keeps_its_reservation(
        nats_url: str) -> None:
    # Prefill takes 2.5 s a batch; unrenewed, a reservation would expire after 1 s.
    async with Stack(nats_url, worker={"fake_prefill_delay_s": 2.5, "kv_wait_timeout_s": 1.0,
                                       "heartbeat_interval_s": 0.2},
                     gateway_options={"heartbeat_timeout_s": 2.0}) as stack:
        nc = await nats.connect(nats_url)
        events: list[KvLeaseEvent] = []
        decoder = msgspec.json.Decoder(KvLeaseEvent)
        async def on_event(msg: nats.aio.msg.Msg) -> None:
            events.append(decoder.decode(msg.data))

        await nc.subscribe(stack.gateway.subjects.all_kv_lease_events, cb=on_event)
        await subscribed(nc)
        try:
            status, body = await stack.post("/v1/completions", {
                "model": MODEL, "prompt": "a long wait", "max_tokens": 4})
            assert status == 200, body
            (decode,) = stack.decodes
            await eventually(lambda: len(events) >= 2)
        finally:
            await nc.close()
        assert decode.metrics.registry.get_sample_value(
            "halfmoon_kv_lease_expirations_total", {"kind": "decode_reservation"}) is None
        assert [(e.action, e.kind) for e in events] == [
            ("granted", "decode_reservation"), ("released", "decode_reservation")]
        assert events[1].held_s >= 2.0  # held through the whole prefill, renewed
        assert events[0].party == stack.prefills[0].worker_id
        assert len(decode.leases) == 0


async def test_a_stalled_loop_judges_no_worker_lost_by_the_silence_it_caused(
        nats_url: str) -> None:
    """The process's own event loop blocks for longer than the heartbeat timeouts (a busy
    CPU, a long compile holding the GIL): it read no heartbeat meanwhile, so neither decode
    (its reservation's prefill worker) nor the gateway (the request's workers) may call a
    healthy worker lost for it."""
    async with Stack(nats_url, worker={"fake_prefill_delay_s": 3.0,
                                       "heartbeat_interval_s": 0.2}) as stack:
        (decode,) = stack.decodes
        request = asyncio.create_task(stack.post("/v1/completions", {
            "model": MODEL, "prompt": "a stall", "max_tokens": 4}))
        await eventually(lambda: len(decode.leases) == 1)
        time.sleep(1.5)  # noqa: ASYNC251 - the stall under test: the loop blocked
        status, body = await request
        assert status == 200, body
        assert decode.metrics.registry.get_sample_value(
            "halfmoon_kv_lease_expirations_total", {"kind": "decode_reservation"}) is None
