"""Two OS processes, real sockets and shared memory, descriptors through a real NATS KV
bucket; data verified by checksum on the far side. Also what a dead or stalled peer does."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import nats
import pytest

from tests.transfer.conftest import SECRET
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import TransferFailed, TransferTimeout
from transfer_engine.registry import NatsEndpointRegistry

SIZE = 32 << 20
BUCKET = "halfmoon_test_transfer"


class PeerProcess:
    def __init__(self, nats_url: str, engine_id: str, transports: str) -> None:
        self.engine_id = engine_id
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.transfer.peer_process", nats_url, BUCKET, engine_id,
             transports, str(SIZE)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.ask_blocking(None) == "ready"

    def ask_blocking(self, command: str | None) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    async def ask(self, command: str) -> str:
        return await asyncio.to_thread(self.ask_blocking, command)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
async def registry(nats_url: str) -> AsyncIterator[NatsEndpointRegistry]:
    client = await nats.connect(nats_url)
    yield await NatsEndpointRegistry.open(client.jetstream(), BUCKET)
    await client.close()


async def local_engine(registry: NatsEndpointRegistry, transports: tuple[str, ...],
                       **options: float) -> TransferEngine:
    engine = TransferEngine(TransferConfig(engine_id=f"local-{os.getpid()}", secret=SECRET,
                                           transports=transports, **options), registry)
    await engine.start()
    return engine


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_bytes_cross_processes_intact_both_ways(
        nats_url: str, registry: NatsEndpointRegistry, transport: str) -> None:
    transports = (transport, "tcp") if transport == "shm" else ("tcp",)
    peer = PeerProcess(nats_url, f"peer-{transport}", ",".join(transports))
    engine = await local_engine(registry, transports)
    try:
        kv = await engine.allocate("kv", SIZE)
        kv[:] = os.urandom(SIZE)
        result = await engine.write(peer.engine_id, [("kv", 0, "kv", 0, SIZE)], notify=b"n1")
        assert result.transport == transport
        assert await peer.ask(f"sha 0 {SIZE}") == hashlib.sha256(kv).hexdigest()
        assert await peer.ask("notes 1") == "n1"

        await peer.ask("fill 11")
        await engine.read(peer.engine_id, [("kv", 0, "kv", 4096, SIZE - 4096)])
        assert await peer.ask(f"sha 4096 {SIZE - 4096}") == \
            hashlib.sha256(kv[:SIZE - 4096]).hexdigest()

        # The other direction: the child writes into this process.
        reply = await peer.ask(f"write {engine.config.engine_id} 100 200 {SIZE - 300}")
        assert reply == f"{transport} {SIZE - 300}"
        assert await peer.ask(f"sha 100 {SIZE - 300}") == \
            hashlib.sha256(kv[200:SIZE - 100]).hexdigest()
    finally:
        peer.stop()
        await engine.close()
    assert await registry.get(engine.config.engine_id) is None  # close() unpublished it


async def test_a_stalled_peer_ends_in_transfer_timeout(
        nats_url: str, registry: NatsEndpointRegistry) -> None:
    peer = PeerProcess(nats_url, "peer-stalled", "tcp")
    engine = await local_engine(registry, ("tcp",), timeout_s=1.0)
    try:
        await engine.allocate("kv", SIZE)
        await engine.write(peer.engine_id, [("kv", 0, "kv", 0, 4096)])  # connected and fine
        peer.process.send_signal(signal.SIGSTOP)
        with pytest.raises(TransferTimeout, match="did not finish within 1 s"):
            await engine.write(peer.engine_id, [("kv", 0, "kv", 0, SIZE)])
    finally:
        peer.process.send_signal(signal.SIGCONT)
        peer.stop()
        await engine.close()


async def test_a_peer_killed_mid_transfer_ends_in_transfer_failed(
        nats_url: str, registry: NatsEndpointRegistry) -> None:
    peer = PeerProcess(nats_url, "peer-killed", "tcp")
    engine = await local_engine(registry, ("tcp",), timeout_s=10.0)
    try:
        await engine.allocate("kv", SIZE)
        await engine.write(peer.engine_id, [("kv", 0, "kv", 0, 4096)])
        peer.process.send_signal(signal.SIGSTOP)  # the write below cannot finish ...
        writing = asyncio.ensure_future(
            engine.write(peer.engine_id, [("kv", 0, "kv", 0, SIZE)]))
        await asyncio.sleep(0.3)
        peer.process.kill()  # ... and then the peer dies under it
        with pytest.raises(TransferFailed, match=r"lost|reset|refused"):
            await writing
        with pytest.raises(TransferFailed, match="cannot connect"):
            await engine.write(peer.engine_id, [("kv", 0, "kv", 0, 4096)])
    finally:
        peer.stop()
        await engine.close()
