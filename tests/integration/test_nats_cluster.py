"""A NATS JetStream cluster of three embedded nodes: every JetStream asset keeps three copies,
and losing the node that leads the request stream loses no request and no token."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Iterator

import nats
import openai
import pytest

from engine.fake_engine import fake_completion
from services.gateway.tokenizer import ByteTokenizer
from shared.errors import ConfigError
from shared.jetstream_assets import ensure_work_queue
from shared.nats_client import CONNECT_TIMEOUT_S, connect
from shared.nats_server import MAX_PAYLOAD_BYTES, EmbeddedNatsCluster
from shared.subjects import Subjects
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
TOKENIZER = ByteTokenizer()
REPLICAS = {"js_replicas": 3}


@pytest.fixture(scope="module")
def nats_cluster() -> Iterator[EmbeddedNatsCluster]:
    cluster = EmbeddedNatsCluster(3)
    cluster.start()
    yield cluster
    cluster.stop()


async def stream_text(sdk: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, stream=True)
    return "".join([choice.text async for chunk in stream for choice in chunk.choices])


async def test_killing_the_request_stream_leader_loses_no_request_and_no_token(
        nats_cluster: EmbeddedNatsCluster) -> None:
    async with Stack(nats_cluster.url, worker={"fake_token_delay_s": 0.03, **REPLICAS},
                     gateway_options=REPLICAS, conductor_options=REPLICAS) as stack:
        nc = await nats.connect(servers=nats_cluster.url.split(","))
        info = await nc.jetstream().stream_info(stack.gateway.subjects.requests_stream)
        assert info.config.num_replicas == 3 and info.cluster is not None
        leader = nats_cluster.node(info.cluster.leader)
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as sdk:
            prompts = [f"cluster {i}" for i in range(8)]
            early = [asyncio.create_task(stream_text(sdk, p, 60)) for p in prompts[:4]]
            await asyncio.sleep(0.8)  # under way: tokens are streaming
            leader.kill()
            # Requests sent after the kill go through the stream's new leader.
            late = [asyncio.create_task(stream_text(sdk, p, 60)) for p in prompts[4:]]
            texts = await asyncio.wait_for(asyncio.gather(*early, *late), 60)
        for prompt, text in zip(prompts, texts, strict=True):
            assert text == TOKENIZER.decode(fake_completion(TOKENIZER.encode(prompt), None, 60))
        leader.restart()
        nats_cluster.wait_healthy()  # it rejoined: JetStream current again
        status, body = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": "after", "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        # The node that came back catches up on the stream: three current copies again.
        # nats-server does the catching up; a busy CI machine once took over 30 s.
        for _ in range(600):
            info = await nc.jetstream().stream_info(stack.gateway.subjects.requests_stream)
            peers = info.cluster.replicas or [] if info.cluster else []
            if len(peers) == 2 and all(peer.current for peer in peers):
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"the restarted node did not catch up: {info.cluster}\n"
                        f"{leader.log_tail()}")
        await nc.close()
        await eventually(lambda: stack.gateway.metrics.failovers._value.get() == 0)  # type: ignore[attr-defined]


async def test_a_message_of_several_mib_crosses_the_cluster(
        nats_cluster: EmbeddedNatsCluster) -> None:
    """Every node carries `MAX_PAYLOAD_BYTES` a message (nats-server's default is 1 MiB, a
    prompt of ~150k tokens), over the routes too."""
    first, *_, last = nats_cluster.nodes
    sender, receiver = await nats.connect(first.url), await nats.connect(last.url)
    try:
        assert sender.max_payload == receiver.max_payload == MAX_PAYLOAD_BYTES
        subscription = await receiver.subscribe("big")
        await receiver.flush()
        payload = bytes(range(256)) * (MAX_PAYLOAD_BYTES // 256 - 64)
        async with asyncio.timeout(10):
            while True:  # until the subscription's interest has crossed the route
                await sender.publish("big", payload)
                try:
                    received = await subscription.next_msg(timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                assert received.data == payload
                break
    finally:
        await sender.close()
        await receiver.close()


async def test_an_asset_with_other_replicas_is_refused_by_name(
        nats_cluster: EmbeddedNatsCluster) -> None:
    nc = await nats.connect(servers=nats_cluster.url.split(","))
    subjects = Subjects("replicas-mismatch")
    js = nc.jetstream()
    try:
        await ensure_work_queue(js, subjects.requests_stream, subjects.requests, 60, replicas=1)
        with pytest.raises(ConfigError, match=r"num_replicas=1 \(this service asks for 3\)"):
            await ensure_work_queue(js, subjects.requests_stream, subjects.requests, 60,
                                    replicas=3)
    finally:
        await js.delete_stream(subjects.requests_stream)
        await nc.close()


async def test_a_client_that_loses_its_server_goes_to_another_without_trying_it_again(
        nats_cluster: EmbeddedNatsCluster) -> None:
    """A node that answers nothing (SIGSTOPped; a partitioned host looks the same) is not
    dialled again first by the clients it served: each goes on to the next server of its
    list at once. Before, nats-py shuffled the list on every reconnect, and one time in
    three a client spent a whole connect timeout (2 s) on the silent node again."""
    outages: dict[int, list[tuple[str, float]]] = {}

    def recorder(index: int) -> Callable[[str], None]:
        return lambda event: outages.setdefault(index, []).append((event, time.monotonic()))

    clients = [await connect(nats_cluster.url, f"rotation-{i}", on_event=recorder(i))
               for i in range(12)]
    ports = [client.connected_url.port for client in clients]  # type: ignore[union-attr]
    port = max(set(ports), key=ports.count)
    (silent,) = [node for node in nats_cluster.nodes if node.url.endswith(f":{port}")]
    served = [i for i, p in enumerate(ports) if p == port]
    silent.send_signal(signal.SIGSTOP)
    try:
        await eventually(lambda: all(len(outages.get(i, ())) >= 2 for i in served), 10.0)
    finally:
        silent.send_signal(signal.SIGCONT)
        for client in clients:
            await client.close()
    await asyncio.to_thread(nats_cluster.wait_healthy)
    for i in served:
        (_, lost_at), (event, back_at) = outages[i][:2]
        assert event == "reconnected"
        assert back_at - lost_at < CONNECT_TIMEOUT_S / 2
    assert {port} != {p for p in ports}  # some were elsewhere: only the silent node's moved
