"""Workers switching between prefill and decode at runtime (`RoleChange`): under load no
request is lost, failed or changed; the engine, its KV pool and prefix cache stay."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.aio.msg
import openai
import pytest

from engine.fake_engine import fake_completion
from services.conductor.service import ConductorService
from services.gateway.tokenizer import ByteTokenizer
from services.worker import WorkerService
from shared.config import PlannerSettings
from shared.messages import (
    AbortRequest,
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    KvTarget,
    RequestEvent,
    RoleChange,
    SamplingParams,
    WorkerHeartbeat,
    WorkerRole,
)
from shared.nats_client import dispatch, encode, subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
TOKENIZER = ByteTokenizer()


async def change_role(stack: Stack, worker: WorkerService, role: WorkerRole) -> DispatchReply:
    return await dispatch(stack.gateway.nc, worker.subjects.role_change(worker.worker_id),
                          RoleChange(role=role, reason="test"), 5)


async def switch(stack: Stack, roles: dict[WorkerService, WorkerRole]) -> None:
    """Change each worker's role, in order; return once the conductor places by them."""
    for worker, role in roles.items():
        assert (await change_role(stack, worker, role)).is_accepted
    await eventually(lambda: all(serves(stack, w, r) for w, r in roles.items()), timeout_s=5)


def serves(stack: Stack, worker: WorkerService, role: WorkerRole) -> bool:
    """The conductor places `role` work on `worker` (it heard the new role's heartbeat)."""
    return worker.worker_id in {hb.worker_id for hb in stack.conductor.workers.healthy(role)}


async def stream_one(sdk: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          stream=True, extra_body={"ignore_eos": True})
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


async def test_switching_roles_under_streaming_load_loses_no_request(nats_url: str) -> None:
    stack = Stack(nats_url, num_prefill=1, num_decode=2,
                  worker={"fake_token_delay_s": 0.01, "fake_prefill_delay_s": 0.005},
                  conductor_options={"policy": "round-robin"})  # it gets prefill work at once
    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        prompts = [f"request {i}: tell me a story" for i in range(48)]
        load = [asyncio.create_task(stream_one(sdk, prompt, 40)) for prompt in prompts]
        switching = stack.decodes[1]
        await eventually(lambda: not switching.duty.is_idle())  # it holds streams now
        assert switching.duty.role == "decode"
        engine = switching.engine
        assert (await change_role(stack, switching, "prefill")).is_accepted
        assert switching.role == "prefill" and switching.engine is engine
        await eventually(lambda: serves(stack, switching, "prefill"), timeout_s=5)
        assert not serves(stack, switching, "decode")
        # More load while it prefills: it takes prefill tasks now.
        load += [asyncio.create_task(stream_one(sdk, f"later {i}", 20)) for i in range(24)]
        texts = await asyncio.gather(*load)
        assert (await change_role(stack, switching, "decode")).is_accepted
        await eventually(lambda: serves(stack, switching, "decode"), timeout_s=5)
    wanted = [(p, 40) for p in prompts] + [(f"later {i}", 20) for i in range(24)]
    assert texts == [TOKENIZER.decode(fake_completion(TOKENIZER.encode(p), None, n))
                     for p, n in wanted]
    tasks_taken = switching.metrics.registry.get_sample_value("halfmoon_prefill_seconds_count")
    assert tasks_taken and tasks_taken > 0  # it did prefill work between the switches
    changes = {(s.labels["from_role"], s.labels["to_role"]): s.value
               for family in switching.metrics.registry.collect()
               if family.name == "halfmoon_role_changes" for s in family.samples
               if s.name.endswith("_total")}
    assert changes == {("decode", "prefill"): 1.0, ("prefill", "decode"): 1.0}


async def test_the_new_role_takes_work_at_once_while_the_old_role_finishes(
        nats_url: str) -> None:
    stack = Stack(nats_url, num_decode=2, worker={"fake_token_delay_s": 0.05},
                  conductor_options={"policy": "round-robin"})  # both prefill workers work
    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        long = asyncio.create_task(stream_one(sdk, "a long one", 60))  # ~3 s of decode
        await eventually(lambda: any(not d.duty.is_idle() for d in stack.decodes), timeout_s=5)
        decode = next(d for d in stack.decodes if not d.duty.is_idle())
        decode_duty = decode.duty
        started = asyncio.get_running_loop().time()
        assert (await change_role(stack, decode, "prefill")).is_accepted
        assert asyncio.get_running_loop().time() - started < 1.0  # not after the stream
        assert decode.role == "prefill" and not long.done()
        await eventually(lambda: serves(stack, decode, "prefill"))
        # It prefills for others while its old stream runs on.
        others = await asyncio.gather(*(stream_one(sdk, f"meanwhile {i}", 3) for i in range(6)))
        assert [len(text) for text in others] == [3] * 6
        assert decode.metrics.registry.get_sample_value("halfmoon_prefill_seconds_count")
        text = await long
        assert text == TOKENIZER.decode(fake_completion(TOKENIZER.encode("a long one"), None, 60))
        await eventually(lambda: decode_duty not in decode.duties, timeout_s=5)  # retired


async def test_a_worker_moved_from_prefill_finishes_its_prefill_for_the_decode_worker_waiting(
        nats_url: str) -> None:
    """Its prefill outlasts four heartbeat intervals after the move. The decode worker that
    holds the request's KV reservation keeps it: the moved worker heartbeats as prefill too
    while its prefill work lasts. So the request is placed and prefilled once."""
    stack = Stack(nats_url, worker={"fake_prefill_s_per_token": 0.05})  # 40 tokens: 2 s
    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        prefill, prompt = stack.prefills[0], "x" * 40
        events = await nats.connect(stack.nats_url)
        kinds: list[str] = []

        async def on_event(msg: nats.aio.msg.Msg) -> None:
            kinds.append(msgspec.json.decode(msg.data, type=RequestEvent).kind)

        await events.subscribe(stack.gateway.subjects.all_request_events, cb=on_event)
        await subscribed(events)
        (prefills_heard,) = stack.decodes[0].duty.worker_views()
        await eventually(lambda: prefills_heard.is_alive(prefill.worker_id))
        try:
            request = asyncio.create_task(stream_one(sdk, prompt, 4))
            await eventually(lambda: not prefill.duty.is_idle(), timeout_s=5)
            assert (await change_role(stack, prefill, "decode")).is_accepted
            text = await request
        finally:
            await events.close()
    assert text == TOKENIZER.decode(fake_completion(TOKENIZER.encode(prompt), None, 4))
    assert kinds.count("placed") == 1 and "migrated" not in kinds, kinds


async def test_role_changes_sent_together_apply_in_order(nats_url: str) -> None:
    stack = Stack(nats_url, num_decode=2, worker={"fake_token_delay_s": 0.05})
    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        streams = [asyncio.create_task(stream_one(sdk, f"s{i}", 20)) for i in range(4)]
        await eventually(lambda: any(not d.duty.is_idle() for d in stack.decodes), timeout_s=5)
        decode = next(d for d in stack.decodes if not d.duty.is_idle())
        decode_duty = decode.duty
        replies = await asyncio.gather(change_role(stack, decode, "prefill"),
                                       change_role(stack, decode, "decode"))
        assert all(reply.is_accepted for reply in replies), replies
        assert decode.role == "decode" and decode.duty is decode_duty  # taken up again
        assert [len(text) for text in await asyncio.gather(*streams)] == [20] * 4
        await eventually(lambda: serves(stack, decode, "decode"))


def reservation(request_id: str, prefill_id: str) -> DecodeReservation:
    return DecodeReservation(prefill_worker_id=prefill_id, request=GenerateRequest(
        request_id=request_id, model=MODEL, prompt_token_ids=list(range(40)),
        sampling=SamplingParams(max_tokens=4), reply_subject="_INBOX.unused",
        created_at_s=time.time()))


async def test_a_draining_decode_worker_names_its_held_blocks_to_a_new_prefill_worker(
        nats_url: str) -> None:
    """The conductor re-placed prefill after the decode worker had started to drain: the
    reservation it holds is re-pointed (not new work), a new one is refused."""
    async with Stack(nats_url) as stack:
        decode, nc = stack.decodes[0], stack.gateway.nc
        targets: dict[str, list[KvTarget]] = {"p-old": [], "p-new": []}
        by_subject = {decode.subjects.kv_target(prefill_id): got
                      for prefill_id, got in targets.items()}

        async def hear(msg: Any) -> None:
            by_subject[msg.subject].append(msgspec.json.decode(msg.data, type=KvTarget))

        for subject in by_subject:
            await nc.subscribe(subject, cb=hear)

        subject = decode.subjects.decode_reserve(decode.worker_id)
        assert (await dispatch(nc, subject, reservation("r1", "p-old"), 5)).is_accepted
        assert (await change_role(stack, decode, "prefill")).is_accepted  # decode drains
        assert (await dispatch(nc, subject, reservation("r1", "p-new"), 5)).is_accepted
        refused = await dispatch(nc, subject, reservation("r2", "p-new"), 5)
        assert not refused.is_accepted and "draining" in refused.reason
        await eventually(lambda: bool(targets["p-new"]), timeout_s=5)
        (old,), (new,) = targets["p-old"], targets["p-new"]
        assert new.request_id == "r1" and new.block_ids == old.block_ids
        await nc.publish(decode.subjects.abort, encode(AbortRequest(request_id="r1")))
        await eventually(lambda: len(decode.duties) == 1, timeout_s=5)  # then it retires


async def test_an_abort_naming_one_worker_frees_the_request_there_only(
        nats_url: str) -> None:
    """The conductor gives up one side of a request placed elsewhere (`AbortRequest` with
    `worker_id`): that worker frees its reservation, the others keep theirs."""
    async with Stack(nats_url, num_decode=2) as stack:
        nc = stack.gateway.nc
        for decode in stack.decodes:
            reply = await dispatch(nc, decode.subjects.decode_reserve(decode.worker_id),
                                   reservation("r1", "p-any"), 5)
            assert reply.is_accepted
        given_up, kept = stack.decodes
        await nc.publish(given_up.subjects.abort, encode(AbortRequest(
            request_id="r1", reason="re-placed", worker_id=given_up.worker_id)))
        await eventually(lambda: given_up.duty.is_idle(), timeout_s=5)
        await asyncio.sleep(0.2)  # the other worker heard the same abort by now
        assert not kept.duty.is_idle()
        await nc.publish(kept.subjects.abort, encode(AbortRequest(request_id="r1")))
        await eventually(lambda: kept.duty.is_idle(), timeout_s=5)


async def test_a_role_change_to_no_role_is_refused(nats_url: str) -> None:
    async with Stack(nats_url) as stack:
        decode = stack.decodes[0]
        reply = await stack.gateway.nc.request(
            decode.subjects.role_change(decode.worker_id),
            b'{"type": "RoleChange", "role": "conductor"}', timeout=5)
        assert b"invalid message" in reply.data and b"conductor" in reply.data
        assert decode.role == "decode"


async def test_a_switched_torch_worker_keeps_its_prefix_cache_and_outputs(
        nats_url: str, tiny_dir: Path) -> None:
    """Prefill moves to the worker that was decode, then back: greedy outputs never change,
    and the original prefill worker's prefix cache survives its stint as decode."""
    stack = Stack(nats_url, num_decode=2, worker={
        "engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256},
        gateway_options={"model_path": str(tiny_dir)})
    body: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time in a land far away, "
                            "there lived a", "max_tokens": 12, "temperature": 0,
                            "ignore_eos": True}
    async with stack:
        prefill, (_, second_decode) = stack.prefills[0], stack.decodes
        status, reference = await stack.post("/v1/completions", body)
        assert status == 200, reference
        await switch(stack, {second_decode: "prefill", prefill: "decode"})
        # Only the switched worker prefills now; either decode worker may decode.
        status, moved = await stack.post("/v1/completions", body)
        assert status == 200, moved
        assert moved["choices"][0]["text"] == reference["choices"][0]["text"]
        assert second_decode.metrics.registry.get_sample_value(
            "halfmoon_prefill_seconds_count") == 1
        # It can share cached prefixes with other prefill workers too, as one started so.
        assert second_decode.prefix_sharing is not None
        await switch(stack, {prefill: "prefill", second_decode: "decode"})
        status, back = await stack.post("/v1/completions", body)
        assert status == 200, back
        assert back["choices"][0]["text"] == reference["choices"][0]["text"]
        cached = back["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16  # the prompt's full blocks, cached before it served as decode
        commits = sum((w.kv_commits for w in stack.services if isinstance(w, WorkerService)),
                      Counter[str]())
        assert commits == {"shm": 3}  # every KV crossed, switched workers' included
        await stack.wait_blocks_free(timeout_s=10)


async def test_the_planner_lends_a_decode_worker_to_prefill_for_a_burst_and_takes_it_back(
        nats_url: str) -> None:
    """A prefill-heavy phase (7 requests a second of 100-token prompts; one prefill worker
    computes 5 a second) moves a decode worker to prefill; once the phase is over it goes
    back to decode. No request fails."""
    planning = PlannerSettings(mode="slo", interval_s=0.2, high=0.1, low=0.03, hold_s=0.5,
                               cooldown_s=1.0, home_after_s=1.0)
    stack = Stack(nats_url, num_prefill=1, num_decode=2,
                  worker={"fake_prefill_s_per_token": 0.002, "fake_prefill_delay_s": 0.001,
                          "fake_token_delay_s": 0.01},
                  conductor_options={"ttft_slo_ms": 10_000, "planning": planning})
    roles_seen: set[tuple[str, str]] = set()

    async def watch() -> None:
        while True:
            roles_seen.update((w.worker_id, w.role) for w in stack.decodes)
            await asyncio.sleep(0.05)

    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        watcher = asyncio.create_task(watch())
        requests = []
        for i in range(56):
            requests.append(asyncio.create_task(sdk.completions.create(
                model=MODEL, prompt=f"{i:03d} " + "x" * 96, max_tokens=4)))
            await asyncio.sleep(1 / 7)
        done = await asyncio.gather(*requests)
        await eventually(lambda: all(w.role == "decode" and len(w.duties) == 1
                                     for w in stack.decodes), timeout_s=20)
        watcher.cancel()
        planning_loop = stack.conductor.planning
        assert planning_loop is not None
        moves = [(move.to_role, outcome) for move, outcome in planning_loop.moves]
    assert all(c.usage is not None and c.usage.completion_tokens == 4 for c in done)
    assert any(role == "prefill" for _, role in roles_seen), roles_seen
    assert moves[:2] == [("prefill", "done"), ("decode", "done")], moves
    assert stack.conductor.metrics.registry.get_sample_value(
        "halfmoon_planner_moves_total", {"to_role": "prefill", "outcome": "done"}) >= 1


async def test_one_conductor_plans_at_a_time_and_another_takes_over_when_it_dies(
        nats_url: str) -> None:
    planning = PlannerSettings(mode="slo", interval_s=0.2)
    stack = Stack(nats_url, conductor_options={"ttft_slo_ms": 1000, "planning": planning})
    async with stack:
        second = ConductorService(stack.conductor.config)
        await second.start()
        try:
            conductors = [stack.conductor, second]

            def leaders() -> list[ConductorService]:
                return [c for c in conductors if c.metrics.registry.get_sample_value(
                    "halfmoon_planner_leader") == 1]

            await eventually(lambda: len(leaders()) == 1, timeout_s=5)
            await asyncio.sleep(1.0)  # renewals: still one
            (leader,) = leaders()
            await leader.nc.close()  # dies: no goodbye, its lease only expires
            for task in list(leader._tasks):
                task.cancel()
            conductors.remove(leader)
            await eventually(lambda: len(leaders()) == 1, timeout_s=5)
        finally:
            await second.stop()


async def test_an_operator_lists_the_workers_and_moves_one_with_halfmoon_assign(
        nats_url: str) -> None:
    async with Stack(nats_url, num_prefill=1, num_decode=2) as stack:
        moving = stack.decodes[1]

        async def halfmoon(*args: str) -> tuple[int, str]:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", *args,
                "--nats-url", nats_url, "--cluster", stack.cluster,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await process.communicate()
            return process.returncode or 0, out.decode()

        def row_of(table: str, worker_id: str) -> list[str]:
            (row,) = [line.split() for line in table.splitlines() if line.startswith(worker_id)]
            return row

        code, table = await halfmoon("workers")
        assert code == 0 and len(table.splitlines()) == 4, table  # a header and 3 workers
        assert row_of(table, moving.worker_id)[1:3] == ["decode", MODEL]
        code, out = await halfmoon("assign", moving.worker_id, "--role", "prefill")
        assert (code, moving.role) == (0, "prefill"), out
        assert f"{moving.worker_id} serves its model as prefill" in out
        for _ in range(20):  # the registry entry is put beside the heartbeat
            code, table = await halfmoon("workers")
            if row_of(table, moving.worker_id)[1] == "prefill":
                break
        assert "serving (home: decode)" in " ".join(row_of(table, moving.worker_id)), table
        code, lines = await halfmoon("workers", "--json")
        heartbeats = [msgspec.json.decode(line, type=WorkerHeartbeat)
                      for line in lines.splitlines()]
        assert {h.worker_id for h in heartbeats} == {
            w.worker_id for w in [*stack.prefills, *stack.decodes]}
        code, out = await halfmoon("assign", moving.worker_id, "--role", "decode",
                                   "--model", "elsewhere")
        assert code == 1 and "`elsewhere` is not on this worker's disk" in out


async def test_the_planner_hears_of_requests_admission_turns_away(nats_url: str) -> None:
    """A TTFT SLO no prefill can keep: the client gets its 429, and the planner counts the
    model's prefill as at its SLO."""
    planning = PlannerSettings(mode="slo", interval_s=0.2)
    stack = Stack(nats_url, worker={"fake_prefill_s_per_token": 0.002},
                  conductor_options={"ttft_slo_ms": 1, "planning": planning})
    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        with pytest.raises(openai.RateLimitError, match="exceeds the SLO"):
            await sdk.completions.create(model=MODEL, prompt="x" * 200, max_tokens=2)
        planning_loop = stack.conductor.planning
        assert planning_loop is not None
        assert planning_loop.slo_rejections.within(time.monotonic(), 5.0) == {
            (MODEL, "prefill")}


async def test_the_planner_spreads_a_crowded_decode_worker_over_a_worker_it_moved_there(
        nats_url: str) -> None:
    """One decode worker runs 12 streams on a batch of 4: the planner moves a prefill worker
    to decode, which starts empty, then tells the crowded one to shed (`ShedLoad`); the
    streams it hands back finish on the other worker, every token as the fake model gives it,
    none lost or repeated, and no failover counted."""
    planning = PlannerSettings(mode="slo", interval_s=0.2, hold_s=0.2, cooldown_s=0.4)
    stack = Stack(nats_url, num_prefill=2, num_decode=1,
                  worker={"fake_token_delay_s": 0.02, "max_batch_size": 4},
                  conductor_options={"tbt_slo_ms": 10_000, "planning": planning})
    async with stack, openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                         max_retries=0) as sdk:
        prompts = [f"crowded {i}" for i in range(12)]
        texts = await asyncio.gather(*(stream_one(sdk, p, 40) for p in prompts))
        planning_loop = stack.conductor.planning
        assert planning_loop is not None
        moves = [(move.to_role, outcome) for move, outcome in planning_loop.moves]
        sheds = [(shed.worker_id, shed.num_requests, outcome)
                 for shed, outcome in planning_loop.sheds]
        crowded = stack.decodes[0]
        shed_count = crowded.metrics.registry.get_sample_value(
            "halfmoon_decode_shed_requests_total")
        moved_to = next(w for w in stack.prefills if w.role == "decode")
        joined_there = sum(moved_to.kv_commits.values())
        failovers = stack.gateway.metrics.registry.get_sample_value(
            "halfmoon_failovers_total")
    assert texts == [TOKENIZER.decode(fake_completion(TOKENIZER.encode(p), None, 40))
                     for p in prompts]
    assert moves[0] == ("decode", "done"), moves
    assert sheds and sheds[0][0] == crowded.worker_id and sheds[0][2] == "done", sheds
    assert shed_count and shed_count >= 1
    assert joined_there >= shed_count  # the handed-back streams went on there
    assert failovers == 0
