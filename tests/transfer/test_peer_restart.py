"""A peer restarted under the same engine id (a worker with a fixed `--worker-id`, or one
that reloaded as another model) is another process with other memory: transfers reach the
new one once it is looked up again, and a transfer addressed to the old one (its
incarnation) never lands in either."""

from __future__ import annotations

import pytest

from tests.transfer.conftest import make_engine
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import PeerRestarted, TransferFailed
from transfer_engine.registry import LocalEndpointRegistry
from transfer_engine.shm import ShmTransport

SIZE = 4096


async def _restarted(target: TransferEngine, registry: LocalEndpointRegistry,
                     transports: tuple[str, ...]) -> tuple[TransferEngine, memoryview]:
    await target.close()
    again = make_engine(target.config.engine_id, transports, registry)
    await again.start()
    return again, await again.allocate("kv", SIZE)


@pytest.mark.parametrize("transports", [("shm", "tcp"), ("tcp",)])
async def test_a_restarted_peer_is_reached_and_its_old_addresses_are_refused(
        transports: tuple[str, ...]) -> None:
    registry = LocalEndpointRegistry()
    source = make_engine("source", transports, registry)
    target = make_engine("target", transports, registry)
    await source.start()
    await target.start()
    again = None
    try:
        data = await source.allocate("kv", SIZE)
        await target.allocate("kv", SIZE)
        data[:] = b"a" * SIZE
        first = await source.write("target", [("kv", 0, "kv", 0, SIZE)],
                                   incarnation=target.incarnation)
        assert first.transport == transports[0]
        old = target.incarnation
        again, kv = await _restarted(target, registry, transports)
        assert again.incarnation != old
        data[:] = b"b" * SIZE
        # Addressed to the new process: the descriptor kept from the old one is dropped and
        # looked up again; the bytes land in the new memory, not the old mapping.
        result = await source.write("target", [("kv", 0, "kv", 0, SIZE)],
                                    incarnation=again.incarnation)
        assert bytes(kv) == b"b" * SIZE and result.transport == transports[0]
        if transports[0] == "shm":  # the old process's mapping is released, not kept
            shm = next(t for t in source._transports if isinstance(t, ShmTransport))
            assert not shm._superseded
            assert [m.incarnation for m in shm._mapped.values()] == [again.incarnation]
        # Addressed to the old one (a target it gave before it restarted): refused.
        data[:] = b"c" * SIZE
        with pytest.raises(PeerRestarted, match="restarted"):
            await source.write("target", [("kv", 0, "kv", 0, SIZE)], incarnation=old)
        assert bytes(kv) == b"b" * SIZE
    finally:
        await source.close()
        await (again or target).close()


async def test_a_caller_without_the_incarnation_reaches_the_restarted_peer_after_one_failure(
        ) -> None:
    """Over tcp the old process's address refuses the connection: that failure drops the
    kept descriptor, and the next transfer finds the new process (before, every later
    transfer failed too, until this engine restarted)."""
    registry = LocalEndpointRegistry()
    source = make_engine("source", ("tcp",), registry)
    target = make_engine("target", ("tcp",), registry)
    await source.start()
    await target.start()
    again = None
    try:
        data = await source.allocate("kv", SIZE)
        await target.allocate("kv", SIZE)
        await source.write("target", [("kv", 0, "kv", 0, SIZE)])
        again, kv = await _restarted(target, registry, ("tcp",))
        data[:] = b"c" * SIZE
        with pytest.raises(TransferFailed):
            await source.write("target", [("kv", 0, "kv", 0, SIZE)])
        await source.write("target", [("kv", 0, "kv", 0, SIZE)])
        assert bytes(kv) == b"c" * SIZE
    finally:
        await source.close()
        await (again or target).close()
