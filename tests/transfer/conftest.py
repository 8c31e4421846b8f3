"""Fixtures for the transfer-engine tests: pairs of real engines on real sockets and real
shared memory, one pair per transport."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from transfer_engine.config import TcpOptions, TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.rdma import detect_devices
from transfer_engine.registry import LocalEndpointRegistry

SECRET = b"test-secret"
SEGMENT_BYTES = 1 << 20

# The transports the conformance suite runs against; rdma runs where a device exists.
TRANSPORTS = ["shm", "tcp", "loopback", pytest.param("rdma", marks=[
    pytest.mark.rdma,
    pytest.mark.skipif(not detect_devices(), reason="no RDMA device: pyverbs is missing or "
                       "get_device_list() found none; the rdma transport is untested here")])]


def make_engine(engine_id: str, transports: tuple[str, ...], registry: LocalEndpointRegistry,
                **options: object) -> TransferEngine:
    tcp = TcpOptions(**{k: v for k, v in options.items() if k in TcpOptions.__annotations__})
    rest = {k: v for k, v in options.items() if k not in TcpOptions.__annotations__}
    config = TransferConfig(engine_id=engine_id, secret=SECRET, transports=transports,
                            tcp=tcp, **rest)  # type: ignore[arg-type]
    return TransferEngine(config, registry)


@dataclass
class Pair:
    """Two started engines; `source` writes to `target`. Each has a 1 MiB shared-memory
    segment named "kv" (`source_kv`, `target_kv`)."""

    transport: str
    source: TransferEngine
    target: TransferEngine
    source_kv: memoryview
    target_kv: memoryview


async def start_pair(transport: str, **options: object) -> Pair:
    transports = (transport, "tcp") if transport in ("shm", "rdma") else (transport,)
    registry = LocalEndpointRegistry()
    source = make_engine(f"source-{transport}", transports, registry, **options)
    target = make_engine(f"target-{transport}", transports, registry, **options)
    await source.start()
    await target.start()
    return Pair(transport, source, target, await source.allocate("kv", SEGMENT_BYTES),
                await target.allocate("kv", SEGMENT_BYTES))


@pytest.fixture(params=TRANSPORTS)
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    running = await start_pair(request.param)
    yield running
    await running.source.close()
    await running.target.close()
