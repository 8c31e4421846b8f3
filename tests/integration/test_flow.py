"""The request flow over NATS: dedupe, replicas, heartbeats, placement spread, token batching."""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import openai
import pytest

from services.conductor.service import ConductorService
from services.gateway import generation
from services.worker import DecodeService, PrefillService
from shared.config import WorkerConfig
from shared.config_loading import load_config
from shared.messages import (
    GenerateRequest,
    PrefillTask,
    SamplingParams,
    TokenBatch,
    TokenDelta,
)
from shared.nats_client import encode
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"


async def test_a_request_published_twice_is_scheduled_once(stack: Stack) -> None:
    js = stack.gateway.nc.jetstream()
    request = GenerateRequest(
        request_id="dup-1", model=MODEL, prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=3), reply_subject="nowhere.listening",
        created_at_s=time.time(),
    )
    subjects = stack.gateway.subjects
    acks = [await js.publish(subjects.requests, encode(request),
                             headers={"Nats-Msg-Id": request.request_id}) for _ in range(2)]
    assert [ack.duplicate for ack in acks] == [None, True]
    deliveries = []

    async def delivered_and_acked() -> bool:
        info = await js.consumer_info(subjects.requests_stream, subjects.conductor_consumer)
        deliveries.append(info.delivered.consumer_seq)
        return info.num_ack_pending == 0 and info.num_pending == 0

    for _ in range(250):
        if await delivered_and_acked():
            break
        await asyncio.sleep(0.02)
    else:
        pytest.fail("the request was not acked within 5 s")
    assert deliveries[-1] == 1
    await stack.wait_blocks_free()


async def test_two_conductor_replicas_never_schedule_a_request_twice(nats_url: str) -> None:
    async with Stack(nats_url) as stack:
        second = ConductorService(stack.conductor.config)
        await second.start()
        try:
            # An observer on the prefill task subject sees every task sent (it never replies).
            seen: list[str] = []
            decoder = msgspec.json.Decoder(PrefillTask)
            prefill = stack.prefills[0]

            async def observe(msg) -> None:  # type: ignore[no-untyped-def]
                seen.append(decoder.decode(msg.data).request.request_id)

            await stack.gateway.nc.subscribe(prefill.subjects.prefill_task(prefill.worker_id),
                                             cb=observe)
            async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                          max_retries=0) as sdk:
                await asyncio.gather(*(sdk.completions.create(
                    model=MODEL, prompt=f"r{i}", max_tokens=3) for i in range(40)))
            await eventually(lambda: len(seen) >= 40)
            assert len(seen) == 40 == len(set(seen))
        finally:
            await second.stop()


async def test_a_request_never_reaches_a_worker_of_another_model(nats_url: str) -> None:
    """Workers of a second model share the cluster (and are the least loaded): every
    request goes to the workers of its own model, and none to theirs."""
    async with Stack(nats_url) as stack:
        flags = {"nats_url": nats_url, "cluster": stack.cluster, "log_level": "warning",
                 "heartbeat_interval_s": 0.2, "engine": "fake", "model": "other-model",
                 "transfer_secret": "stack-secret"}
        others = [PrefillService(load_config(WorkerConfig, flags=flags)),
                  DecodeService(load_config(WorkerConfig, flags=flags))]
        reached: list[str] = []

        async def observe(msg) -> None:  # type: ignore[no-untyped-def]
            reached.append(msg.subject)

        for other in others:
            await other.start()
            for subject in (other.subjects.prefill_task(other.worker_id),
                            other.subjects.decode_reserve(other.worker_id)):
                await stack.gateway.nc.subscribe(subject, cb=observe)
        try:
            await eventually(lambda: len(stack.conductor.workers.healthy("decode")) == 2
                             and len(stack.conductor.workers.healthy("prefill")) == 2)
            async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                          max_retries=0) as sdk:
                await asyncio.gather(*(sdk.completions.create(
                    model=MODEL, prompt=f"p{i}", max_tokens=3) for i in range(20)))
            assert reached == []
            health = stack.gateway.health()  # the gateway counts its own model's workers
            assert (health["num_prefill_workers"], health["num_decode_workers"]) == (1, 1)
        finally:
            for other in others:
                await other.stop()


async def test_work_spreads_over_workers_and_skips_a_silent_one(nats_url: str) -> None:
    async with Stack(nats_url, num_prefill=2, num_decode=2,
                     worker={"fake_token_delay_s": 0.01}) as stack:
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            await asyncio.gather(*(sdk.completions.create(
                model=MODEL, prompt=f"s{i}", max_tokens=20) for i in range(16)))
            # Silence one decode worker's heartbeats: it must get no new work.
            silent = stack.decodes[1]
            for task in list(silent._tasks):
                if task.get_name().endswith("heartbeat"):
                    task.cancel()
            await eventually(lambda: not stack.conductor.workers.is_healthy(silent.worker_id),
                             timeout_s=5.0)
            reservations_before = silent.engine.stats().num_free_blocks
            results = await asyncio.gather(*(sdk.completions.create(
                model=MODEL, prompt=f"t{i}", max_tokens=5) for i in range(10)))
        assert all(r.usage is not None and r.usage.completion_tokens == 5 for r in results)
        assert silent.engine.stats().num_free_blocks == reservations_before
        await stack.wait_blocks_free()


async def test_decode_sends_one_batch_per_gateway_per_step(nats_url: str) -> None:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.02}) as stack:
        batches: list[TokenBatch] = []
        decoder = msgspec.json.Decoder(TokenBatch)

        async def spy(msg) -> None:  # type: ignore[no-untyped-def]
            batches.append(decoder.decode(msg.data))

        await stack.gateway.nc.subscribe(
            stack.gateway.subjects.gateway(stack.gateway.gateway_id), cb=spy)
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            await asyncio.gather(*(sdk.completions.create(
                model=MODEL, prompt=f"b{i}", max_tokens=30) for i in range(8)))
        decode_batches = [b for b in batches if b.worker_id == stack.decodes[0].worker_id]
        tokens = sum(len(b.items) for b in decode_batches)
        assert tokens == 8 * 29
        assert max(len(b.items) for b in decode_batches) == 8  # the whole batch, one message
        assert len(decode_batches) < tokens / 4


async def test_a_gateway_clock_running_behind_does_not_expire_its_requests(
        stack: Stack) -> None:
    """A request made on a host whose clock is two minutes behind the conductor's (past the
    60 s `request_max_age_s`): its age counts from when the stream stored it too, so it is
    served; before, every request of such a gateway was dropped as expired on arrival."""
    nc, subjects = stack.gateway.nc, stack.gateway.subjects
    replies = await nc.subscribe(f"test.skewed.{time.monotonic_ns()}")
    request = GenerateRequest(
        request_id="skewed-1", model=MODEL, prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=3), reply_subject=replies.subject,
        created_at_s=time.time() - 120)
    await nc.jetstream().publish(subjects.requests, encode(request),
                                 headers={"Nats-Msg-Id": request.request_id})
    decoder = msgspec.json.Decoder(TokenBatch)
    deltas: list[TokenDelta] = []
    while not deltas or deltas[-1].finish_reason is None:
        msg = await replies.next_msg(timeout=10)  # RequestPlaced first, then TokenBatches
        with contextlib.suppress(msgspec.ValidationError):
            deltas += decoder.decode(msg.data).items
    assert sum(len(delta.token_ids) for delta in deltas) == 3
    await stack.wait_blocks_free()


async def test_a_burst_past_the_gateway_s_queueing_limit_waits_its_turn(
        nats_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most `MAX_QUEUEING` requests are being published into the request stream at once
    (2 here); the others wait for a turn, and every one is served."""
    monkeypatch.setattr(generation, "MAX_QUEUEING", 2)
    async with Stack(nats_url) as stack:
        queueing = stack.gateway.generator._ctx.queueing
        publishing = [0, 0]  # now, most at once
        acquire, release = queueing.acquire, queueing.release

        async def counted_acquire() -> bool:
            taken = await acquire()
            publishing[0] += 1
            publishing[1] = max(publishing)
            return taken

        def counted_release() -> None:
            publishing[0] -= 1
            release()

        monkeypatch.setattr(queueing, "acquire", counted_acquire)
        monkeypatch.setattr(queueing, "release", counted_release)
        body = {"model": MODEL, "prompt": "burst", "max_tokens": 4}
        replies = await asyncio.gather(*(stack.post("/v1/completions", body)
                                         for _ in range(16)))
        assert [status for status, _ in replies] == [200] * 16
        assert publishing == [0, 2]  # the limit reached, never passed
