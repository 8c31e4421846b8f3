"""halfmoon across hosts: network namespaces joined by a bridge (`bench.netbed`), each process
on its host, KV between hosts over TCP only. The smoke test and a NATS client cut off from
its server run in `make test`; the fault scenarios are marked `cluster` (run with
-m cluster). Skipped where namespaces cannot be made."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from nats.aio.client import Client as NatsClient

from bench.cluster import BedCluster, Placement
from bench.netbed import PREFIX, NetBed
from engine.fake_engine import fake_completion
from services.gateway.tokenizer import ByteTokenizer
from shared.nats_client import connect

UNAVAILABLE = NetBed.unavailable()
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(UNAVAILABLE is not None, reason=UNAVAILABLE or "")]

MODEL = "halfmoon-tiny"
TOKENIZER = ByteTokenizer()
FAKE = {"worker_flags": ["--engine", "fake", "--fake-token-delay-s", "0.03"],
        "gateway_flags": ["--tokenizer", "bytes"]}


def torch_worker(tiny_dir: Path) -> list[str]:
    return ["--engine", "torch", "--model-path", str(tiny_dir), "--num-blocks", "256"]


def transferred(cluster: BedCluster, role: str, index: int) -> dict[str, float]:
    """KV bytes a worker moved, by transport."""
    samples = cluster.worker_metrics(role, index)
    return {key.split('transport="')[1].rstrip('"}'): value for key, value in samples.items()
            if key.startswith("halfmoon_kv_transfer_bytes_total{")}


@pytest.fixture
def two_hosts(tiny_dir: Path) -> Iterator[BedCluster]:
    """NATS, conductor, gateway and a prefill worker on one host, a decode worker on another."""
    with NetBed(2) as bed:
        cluster = BedCluster(bed, Placement(), worker_flags=torch_worker(tiny_dir),
                             gateway_flags=["--model-path", str(tiny_dir)])
        try:
            yield cluster.start()
        finally:
            cluster.close()


def test_kv_crosses_hosts_over_tcp_only(two_hosts: BedCluster) -> None:
    client = openai.OpenAI(base_url=f"{two_hosts.gateway_url}/v1", api_key="x", max_retries=0)
    prompt = "a prompt that fills a few KV blocks on one host " * 3
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    moved = transferred(two_hosts, "prefill", 0)
    assert moved.get("tcp", 0) > 0 and moved.get("shm", 0) == 0, moved


@pytest.mark.cluster
def test_a_partitioned_decode_host_fails_over_and_rejoins(tiny_dir: Path) -> None:
    """Scenario (b): the link of a decode worker's host goes down while it streams; its
    requests finish on the other decode host, and the host serves again once the link is
    back."""
    with NetBed(3) as bed:
        cluster = BedCluster(bed, Placement(decode=(1, 2)), **FAKE)
        try:
            cluster.start()
            asyncio.run(_stream_while(cluster, lambda: bed.cut(bed.hosts[1]), num=8))
            deadline = time.monotonic() + 10
            while cluster.health().get("num_decode_workers") != 1:
                assert time.monotonic() < deadline, cluster.health()
                time.sleep(0.1)
            bed.heal(bed.hosts[1])
            deadline = time.monotonic() + 20
            while cluster.health().get("num_decode_workers") != 2:
                assert time.monotonic() < deadline, cluster.health()
                time.sleep(0.1)
            asyncio.run(_stream_while(cluster, lambda: None, num=8))
            # Nothing leaks: every worker, the partitioned one too, holds no KV block.
            workers = [("prefill", 0), ("decode", 1), ("decode", 2)]
            deadline = time.monotonic() + 20
            while any(cluster.worker_metrics(*worker)["halfmoon_kv_blocks_used"]
                      for worker in workers):
                assert time.monotonic() < deadline, [
                    cluster.worker_metrics(*worker)["halfmoon_kv_blocks_used"]
                    for worker in workers]
                time.sleep(0.2)
        finally:
            cluster.close()


@pytest.mark.cluster
def test_a_partitioned_nats_host_leaves_service_running(tiny_dir: Path) -> None:
    """Scenario (c): NATS runs as three nodes on three hosts; the services on a fourth host.
    Cutting off one NATS node's host loses no request."""
    with NetBed(4) as bed:
        cluster = BedCluster(bed, Placement(nats=(0, 1, 2), conductor=3, gateway=3,
                                            prefill=(3,), decode=(3,)), **FAKE)
        try:
            cluster.start()
            asyncio.run(_stream_while(cluster, lambda: bed.cut(bed.hosts[0]), num=8))
            asyncio.run(_stream_while(cluster, lambda: None, num=4))
            bed.heal(bed.hosts[0])
        finally:
            cluster.close()


async def _stream_while(cluster: BedCluster, fault: object, num: int) -> None:
    """`num` streaming requests of the fake engine; `fault()` once tokens flow. Every stream
    completes with exactly its output (no token lost or repeated)."""
    async with openai.AsyncOpenAI(base_url=f"{cluster.gateway_url}/v1", api_key="x",
                                  max_retries=0) as sdk:
        async def one(i: int) -> str:
            stream = await sdk.completions.create(model=MODEL, prompt=f"host {i}",
                                                  max_tokens=60, temperature=0, stream=True)
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].choices[0].finish_reason == "length"
            return "".join(choice.text for chunk in chunks for choice in chunk.choices)

        tasks = [asyncio.create_task(one(i)) for i in range(num)]
        await asyncio.sleep(0.6)
        fault()  # type: ignore[operator]
        texts = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    for i, text in enumerate(texts):
        prompt = TOKENIZER.encode(f"host {i}")
        assert text == TOKENIZER.decode(fake_completion(prompt, None, 60))


def test_a_client_streaming_to_a_cut_off_server_moves_to_another_one() -> None:
    """A partition acknowledges nothing, so a client that keeps publishing (a decode worker
    streaming tokens) has bytes unsent when its pings give up; nats-py closes that connection
    before it reconnects, which took until TCP gave up (minutes): the worker was lost to the
    cluster for the partition's length. Now it is on another node within seconds."""
    with NetBed(2) as bed:
        cluster = BedCluster(bed, Placement(nats=(0, 1)), worker_flags=[])
        try:
            cluster.start_nats(0)
            cluster.start_nats(1)
            asyncio.run(_publish_through_a_cut(bed))
        finally:
            cluster.close()


async def _publish_through_a_cut(bed: NetBed) -> None:
    first, other = (f"{host.address}:4222" for host in bed.hosts)
    nc = await _connect_when_routed(f"nats://{first}")
    try:
        assert nc.connected_url is not None and nc.connected_url.netloc == first

        async def stream() -> None:  # 40 KB/s, as a decode worker's tokens
            while True:
                await nc.publish("tokens", b"t" * 400)
                await asyncio.sleep(0.01)

        streaming = asyncio.create_task(stream())
        await asyncio.sleep(0.5)
        bed.cut(bed.hosts[0])
        started = time.monotonic()
        while nc.connected_url is None or nc.connected_url.netloc != other:
            assert time.monotonic() - started < 15, "still not on the other node"
            await asyncio.sleep(0.1)
        streaming.cancel()
        assert time.monotonic() - started < 10
    finally:
        bed.heal(bed.hosts[0])
        await nc.close()


async def _connect_when_routed(url: str) -> NatsClient:
    """A client of the first node once the node tells clients of the other (its INFO lists
    every node's client URL when the route is up)."""
    deadline = time.monotonic() + 20
    while True:
        nc = await connect(url, "cut-test")
        if len(nc.servers) > 1:
            return nc
        await nc.close()
        assert time.monotonic() < deadline, "the two nodes never routed"
        await asyncio.sleep(0.3)


def test_the_bed_leaves_nothing_behind_after_a_failure() -> None:
    def names() -> str:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    made: list[tuple[NetBed, subprocess.Popen[bytes]]] = []

    def fail_inside_a_bed() -> None:
        with NetBed(2) as bed:
            made.append((bed, bed.spawn(bed.hosts[1], ["sleep", "60"])))
            bed.shape(bed.hosts[1], 100)
            assert bed.hosts[1].name in names()
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_inside_a_bed()
    (bed, sleeper), = made
    assert all(host.name not in names() for host in bed.hosts)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout
    assert PREFIX not in links
    assert sleeper.poll() is not None


@pytest.mark.cluster
def test_the_cluster_benchmark_serves_its_stream_across_hosts_and_on_one() -> None:
    """`bench.cluster`'s scenario (b), small: both setups serve every request."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.cluster", "--scenarios", "serving", "--num-requests", "6",
         "--rate", "4"], capture_output=True, text=True, timeout=400, check=True)
    rows = {" ".join(line.split()[:2]): line.split() for line in done.stdout.splitlines()}
    for setup in ("across hosts", "one host"):
        assert rows[setup][2:4] == ["6", "6"], done.stdout  # sent, ok
