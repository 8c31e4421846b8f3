"""The public request-lifecycle events, as an outside subscriber sees them on NATS."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import nats
import pytest

from shared.messages import RequestEvent
from shared.nats_client import subscribed
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
PROMPT = "Once upon a time, a secret word"


@asynccontextmanager
async def subscriber(stack: Stack) -> AsyncIterator[list[RequestEvent]]:
    """Every request event of the stack's cluster, through a connection of its own."""
    nc = await nats.connect(stack.nats_url)
    events: list[RequestEvent] = []
    decoder = msgspec.json.Decoder(RequestEvent)

    async def on_message(msg: nats.aio.msg.Msg) -> None:
        assert msg.subject.endswith(f".events.request.{decoder.decode(msg.data).kind}")
        assert PROMPT.encode() not in msg.data
        events.append(decoder.decode(msg.data))

    await nc.subscribe(stack.gateway.subjects.all_request_events, cb=on_message)
    await subscribed(nc)  # the server has the subscription before any request is sent
    try:
        yield events
    finally:
        await nc.close()


def kinds_of(events: list[RequestEvent], request_id: str) -> list[str]:
    return [event.kind for event in events if event.request_id == request_id]


async def test_a_served_request_emits_its_lifecycle_in_order(stack: Stack) -> None:
    async with subscriber(stack) as events:
        status, body = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        request_id = body["id"]
        await eventually(lambda: "finished" in kinds_of(events, request_id))
    kinds = kinds_of(events, request_id)
    # One publisher's events arrive in order, and `accepted` before anyone else's; the
    # conductor's `placed` and the prefill worker's commit race the gateway's first token.
    assert sorted(kinds) == sorted(["accepted", "placed", "first_token", "kv_committed",
                                    "finished"])
    assert kinds[0] == "accepted"
    assert [k for k in kinds if k in ("accepted", "first_token", "finished")] == [
        "accepted", "first_token", "finished"]
    by_kind = {event.kind: event for event in events if event.request_id == request_id}
    placed, finished = by_kind["placed"], by_kind["finished"]
    assert placed.source == stack.conductor.instance_id
    assert placed.prefill_worker_id == stack.prefills[0].worker_id
    assert placed.path == "disaggregated"
    assert (finished.source, finished.model) == (stack.gateway.instance_id, MODEL)
    assert finished.decode_worker_id == stack.decodes[0].worker_id
    assert finished.num_prompt_tokens == len(PROMPT.encode())
    assert (finished.num_output_tokens, finished.finish_reason) == (5, "length")
    assert finished.ttft_s is not None and finished.e2e_s is not None
    assert 0 < finished.ttft_s <= finished.e2e_s
    assert finished.itl_mean_s is not None and finished.itl_max_s is not None
    assert 0 < finished.itl_mean_s <= finished.itl_max_s


async def test_the_kv_handoff_is_an_event_with_its_bytes_and_transport(
        torch_stack: Stack) -> None:
    async with subscriber(torch_stack) as events:
        status, body = await torch_stack.post("/v1/completions", {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        await eventually(lambda: "finished" in kinds_of(events, body["id"]))
    (committed,) = [e for e in events if e.kind == "kv_committed"]
    assert committed.source == torch_stack.prefills[0].worker_id
    assert committed.decode_worker_id == torch_stack.decodes[0].worker_id
    assert committed.transport == "shm" and committed.num_kv_bytes > 0
    assert committed.kv_seconds is not None and committed.kv_seconds > 0


async def test_a_client_that_leaves_early_ends_its_request_as_aborted(nats_url: str) -> None:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05}) as stack, \
            subscriber(stack) as events:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(stack.post("/v1/completions", {
                "model": MODEL, "prompt": PROMPT, "max_tokens": 200}), 0.5)
        await eventually(lambda: any(e.kind == "finished" for e in events), timeout_s=10)
    (finished,) = [e for e in events if e.kind == "finished"]
    assert finished.finish_reason == "abort"


async def test_a_rejected_request_ends_with_a_failed_event(nats_url: str) -> None:
    """Once the hold for a worker to come back (here 0.5 s) is spent."""
    async with Stack(nats_url, conductor_options={"no_worker_hold_s": 0.5}) as stack:
        for decode in stack.decodes:
            await decode.stop()
        await eventually(lambda: not stack.gateway.workers.healthy("decode"), timeout_s=5)
        async with subscriber(stack) as events:
            status, _ = await stack.post("/v1/completions", {
                "model": MODEL, "prompt": PROMPT, "max_tokens": 4})
            assert status == 503
            await eventually(lambda: any(e.kind == "failed" for e in events))
        (failed,) = [e for e in events if e.kind == "failed"]
        assert failed.error_code and failed.error
        assert kinds_of(events, failed.request_id)[0] == "accepted"


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "nats_subscriber.py"


async def test_the_example_subscriber_shows_the_clusters_traffic(torch_stack: Stack) -> None:
    script = EXAMPLE
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(script), "--nats", torch_stack.nats_url, "--cluster",
        torch_stack.cluster, "--duration-s", "4", "--interval-s", "0.25",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert process.stdout is not None
    await asyncio.wait_for(process.stdout.readline(), 10)  # subscribed and reporting
    for _ in range(3):
        status, body = await torch_stack.post("/v1/completions", {
            "model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert status == 200, body
    out, err = await asyncio.wait_for(process.communicate(), 20)
    assert process.returncode == 0, err.decode()
    last = out.decode().splitlines()[-4:]
    assert "finished 3" in last[0] and "failed 0" in last[0], last
    assert re.search(r"TTFT ms\s+p50\s+\d+\.\d", last[1]), last
    assert re.search(r"KV moved shm \d+\.\d\d MB", last[3]), last


def test_the_example_subscriber_splits_latency_by_priority_when_there_are_several(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("nats_subscriber", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "nats_subscriber", example)  # for its dataclass
    spec.loader.exec_module(example)
    view = example.View()
    for i, (priority, e2e_s) in enumerate([(0, 2.0), (0, 4.0), (-1, 0.5)]):
        view.apply({"kind": "finished", "request_id": f"r{i}", "e2e_s": e2e_s,
                    "priority": priority})
        if i == 1:
            assert not any("by priority" in line for line in view.lines())  # one priority
    assert view.lines()[-1] == "E2E ms p50 by priority  -1: 500.0   0: 2000.0"
