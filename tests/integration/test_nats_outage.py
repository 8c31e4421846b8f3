"""A NATS outage is not worker death: streams in flight survive a server restart of a few
seconds, and nothing is failed over."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable, Iterator

import pytest
from nats.aio.msg import Msg

from engine.fake_engine import fake_completion
from services.gateway.tokenizer import ByteTokenizer
from shared.heartbeats import WorkerDirectory
from shared.jetstream_assets import read_registry
from shared.messages import GatewayEvent
from shared.nats_client import ServerProbe, connect, subscribed
from shared.nats_server import EmbeddedNatsServer
from tests.stack import Stack, eventually
from tests.unit.test_placement import worker

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
TOKENIZER = ByteTokenizer()


@pytest.fixture
def own_server() -> Iterator[EmbeddedNatsServer]:
    """A nats-server of this test's own, to kill and restart (its store survives)."""
    server = EmbeddedNatsServer()
    server.start()
    yield server
    server.stop()


async def test_streams_survive_a_nats_restart_and_no_worker_is_failed_over(
        own_server: EmbeddedNatsServer) -> None:
    async def outage() -> None:
        own_server.kill()
        await asyncio.sleep(2.0)
        own_server.restart()

    stack = await _streams_through(own_server, outage)
    assert stack.gateway.metrics.failovers._value.get() == 0  # type: ignore[attr-defined]


async def test_a_server_that_stops_answering_is_not_taken_for_lost_workers(
        own_server: EmbeddedNatsServer) -> None:
    """A server that answers nothing for a while (cut off by a partition, or stalled) closes
    no connection: the gateway hears no heartbeat for longer than its timeout (1 s here)
    before its client's pings tell it (up to 3 s). It asks the server before failing a
    stream over, and fails nothing over."""
    async def stall() -> None:
        own_server.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.8)  # past the heartbeat timeout, short of the pings' limit
        finally:
            own_server.send_signal(signal.SIGCONT)

    stack = await _streams_through(own_server, stall)
    assert stack.gateway.metrics.failovers._value.get() == 0  # type: ignore[attr-defined]
    assert stack.gateway.metrics.nats_reconnects._value.get() == 0  # type: ignore[attr-defined]


async def _streams_through(server: EmbeddedNatsServer,
                           fault: Callable[[], Awaitable[None]]) -> Stack:
    """Four greedy streams of the fake engine with `fault()` a second in; each completes with
    exactly its output. Returns the (stopped) stack, to read its metrics."""
    async with Stack(server.url, worker={"fake_token_delay_s": 0.04}) as stack:
        prompts = [f"outage {i}" for i in range(4)]
        requests = [asyncio.create_task(stack.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 80, "temperature": 0}))
            for prompt in prompts]
        await asyncio.sleep(1.0)  # every stream under way
        await fault()
        results = await asyncio.wait_for(asyncio.gather(*requests), 60)
        for prompt, (status, body) in zip(prompts, results, strict=True):
            assert status == 200, body
            expected = TOKENIZER.decode(fake_completion(TOKENIZER.encode(prompt), None, 80))
            assert body["choices"][0]["text"] == expected
    return stack


async def test_a_gateway_that_missed_where_its_requests_went_finds_them(nats_url: str) -> None:
    """The gateway hears nothing on its own subject for a while (as when its connection
    dropped under load: no `RequestPlaced`, no token): one request finishes meanwhile, one is
    half done. Asked among every decode worker (`StreamResume.is_unplaced`), the one that
    holds them says where they run and sends their tokens again: both complete exactly,
    where both waited to the request timeout (504) before."""
    async with Stack(nats_url, num_decode=2, worker={"fake_token_delay_s": 0.03},
                     gateway_options={"resume_after_s": 0.25}) as stack:
        gateway = stack.gateway
        reply_subject = gateway.subjects.gateway(gateway.gateway_id)
        (deaf,) = [sub for sub in gateway.nc._subs.values() if sub.subject == reply_subject]
        await deaf.unsubscribe()
        lengths = {"missed, short": 8, "missed, long": 120}
        requests = [asyncio.create_task(stack.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}))
            for prompt, max_tokens in lengths.items()]
        await eventually(lambda: sum(d.engine.stats().num_running for d in stack.decodes) == 1)
        await gateway.serve(reply_subject, GatewayEvent, gateway._on_event)  # hears again
        results = await asyncio.wait_for(asyncio.gather(*requests), 20)
        for (prompt, max_tokens), (status, body) in zip(lengths.items(), results, strict=True):
            assert status == 200, body
            expected = fake_completion(TOKENIZER.encode(prompt), None, max_tokens)
            assert body["choices"][0]["text"] == TOKENIZER.decode(expected)
        assert gateway.metrics.failovers._value.get() == 0  # type: ignore[attr-defined]


async def test_lost_jetstream_assets_are_declared_again(nats_url: str) -> None:
    """Every stream and bucket deleted under a running stack (by an operator, or lost with a
    server that restarted without its store): the gateway's publishes find no stream, the
    conductor's pulls no consumer, the workers' registry puts no bucket. Each declares its
    own again: requests are served, the registry fills; before, every request was refused
    (503) until each service restarted."""
    async with Stack(nats_url) as stack:
        body = {"model": MODEL, "prompt": "lost", "max_tokens": 8, "temperature": 0}
        assert (await stack.post("/v1/completions", body))[0] == 200
        js = stack.gateway.nc.jetstream()
        for stream in await js.streams_info():
            if stack.cluster.upper() in stream.config.name.upper():  # this stack's own
                await js.delete_stream(stream.config.name)
        status, answer = await asyncio.wait_for(stack.post("/v1/completions", body), 30)
        assert status == 200, answer
        expected = TOKENIZER.decode(fake_completion(TOKENIZER.encode("lost"), None, 8))
        assert answer["choices"][0]["text"] == expected
        deadline = time.monotonic() + 10
        while stack.decodes[0].worker_id not in {entry.worker_id for entry in await read_registry(
                js, stack.gateway.subjects.workers_bucket)}:
            assert time.monotonic() < deadline, "the registry was not declared again"
            await asyncio.sleep(0.2)


async def test_the_server_probe_hears_a_stalled_server_again_and_breaks_nothing(
        own_server: EmbeddedNatsServer) -> None:
    """No answer while the server is stopped; answers once it runs again; and the PING left
    unanswered meanwhile, answered late, leaves the client reading (nats-py stops its read
    loop on a PONG for a flush it gave up on)."""
    nc = await connect(own_server.url, "probe-test")
    try:
        probe = ServerProbe(nc)
        assert await probe.answers(1.0)
        own_server.send_signal(signal.SIGSTOP)
        await asyncio.sleep(0.2)  # stopped by now (a signal takes effect at its next tick)
        try:
            started = time.monotonic()
            assert not await probe.answers(0.5)
            assert not await probe.answers(0.5)  # the same PING, still unanswered
            assert time.monotonic() - started < 1.0
        finally:
            own_server.send_signal(signal.SIGCONT)
        assert await probe.answers(2.0)
        received: list[bytes] = []

        async def receive(msg: Msg) -> None:
            received.append(msg.data)

        await nc.subscribe("probe.after", cb=receive)
        await nc.publish("probe.after", b"still reading")
        await subscribed(nc, 2)
        assert received == [b"still reading"]
    finally:
        await nc.close()


def test_heartbeat_judgments_wait_while_disconnected_and_one_interval_after() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("p1"), now_s=100.0)
    directory.suspend(now_s=101.0)  # our own connection dropped
    assert directory.is_alive("p1", now_s=110.0)  # no news is not bad news while away
    directory.resume(now_s=110.0)
    assert directory.is_alive("p1", now_s=111.5)  # its heartbeats have time to come back
    assert not directory.is_alive("p1", now_s=112.5)  # they did not: it is lost


def test_a_worker_that_heartbeats_after_the_outage_stays_alive() -> None:
    directory = WorkerDirectory(timeout_s=2.0)
    directory.observe(worker("p1"), now_s=100.0)
    directory.suspend(now_s=100.5)
    directory.resume(now_s=105.0)
    directory.observe(worker("p1"), now_s=105.5)
    assert directory.is_alive("p1", now_s=107.0)
    assert [w.worker_id for w in directory.healthy("prefill", now_s=107.0)] == ["p1"]


def test_entries_are_not_expired_while_disconnected() -> None:
    forgotten: list[str] = []
    directory = WorkerDirectory(timeout_s=1.0, on_expire=forgotten.append)
    now = time.monotonic()
    directory.observe(worker("p1"), now_s=now)
    directory.suspend(now_s=now + 0.5)
    assert [w.worker_id for w in directory.healthy("prefill", now_s=now + 60)] == ["p1"]
    assert forgotten == []


class _StalledBucket:
    """A registry bucket whose puts wait as a KV bucket's do while its leader moves, until
    nats-py's JetStream timeout (5 s)."""

    def __init__(self) -> None:
        self.num_puts = 0

    async def put(self, key: str, value: bytes) -> int:
        self.num_puts += 1
        await asyncio.sleep(5.0)
        return 0

    async def delete(self, key: str) -> bool:
        return True


async def test_a_stalled_registry_put_holds_up_no_heartbeat(nats_url: str) -> None:
    """A NATS node lost moves the registry bucket's leader: its puts wait seconds. The
    heartbeats go on meanwhile, or every conductor would judge every worker lost."""
    async with Stack(nats_url) as stack:
        decode = stack.decodes[0]
        bucket = _StalledBucket()
        decode.heartbeats._registry = bucket  # type: ignore[assignment]
        beats: list[float] = []

        async def count(_msg: object) -> None:
            beats.append(time.monotonic())

        subscription = await stack.conductor.nc.subscribe(
            stack.conductor.subjects.heartbeat("decode", decode.worker_id), cb=count)
        await subscribed(stack.conductor.nc)
        await asyncio.sleep(2.0)
        await subscription.unsubscribe()
        assert len(beats) >= 3, beats  # every 0.5 s, not one per stalled put
        assert bucket.num_puts == 1  # one put in flight at a time
        assert stack.conductor.workers.is_alive(decode.worker_id)
