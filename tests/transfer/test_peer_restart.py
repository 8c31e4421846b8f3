"""A peer restarted under the same engine id (a worker with a fixed `--worker-id`, or one
that reloaded as another model) is another process with other memory: transfers reach the
new one once it is looked up again, and a transfer addressed to the old one (its
incarnation) never lands in either."""

from __future__ import annotations

import pytest

from tests.transfer.conftest import make_engine
from transfer_engine.errors import PeerRestarted, TransferFailed
from transfer_engine.registry import LocalEndpointRegistry
from transfer_engine.shm import ShmTransport

SIZE = 4096
WHOLE = [("kv", 0, "kv", 0, SIZE)]


class Peers:
    """A source and a target engine on one registry, each with a segment "kv"; the target
    can restart under its engine id (`restart`)."""

    def __init__(self, transports: tuple[str, ...]) -> None:
        self.transports = transports
        self.registry = LocalEndpointRegistry()
        self.source = make_engine("source", transports, self.registry)
        self.target = make_engine("target", transports, self.registry)

    async def __aenter__(self) -> Peers:
        await self.source.start()
        await self.target.start()
        self.data = await self.source.allocate("kv", SIZE)
        self.target_kv = await self.target.allocate("kv", SIZE)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.source.close()
        await self.target.close()

    async def restart(self) -> None:
        await self.target.close()
        self.target = make_engine("target", self.transports, self.registry)
        await self.target.start()
        self.target_kv = await self.target.allocate("kv", SIZE)


@pytest.mark.parametrize("transports", [("shm", "tcp"), ("tcp",)])
async def test_a_restarted_peer_is_reached_and_its_old_addresses_are_refused(
        transports: tuple[str, ...]) -> None:
    async with Peers(transports) as peers:
        source = peers.source
        peers.data[:] = b"a" * SIZE
        first = await source.write("target", WHOLE, incarnation=peers.target.incarnation)
        assert first.transport == transports[0]
        old = peers.target.incarnation
        await peers.restart()
        assert peers.target.incarnation != old
        peers.data[:] = b"b" * SIZE
        # Addressed to the new process: the descriptor kept from the old one is dropped and
        # looked up again; the bytes land in the new memory, not the old mapping.
        result = await source.write("target", WHOLE, incarnation=peers.target.incarnation)
        assert bytes(peers.target_kv) == b"b" * SIZE and result.transport == transports[0]
        if transports[0] == "shm":  # the old process's mapping is released, not kept
            shm = next(t for t in source._transports if isinstance(t, ShmTransport))
            assert not shm._superseded
            assert [m.incarnation for m in shm._mapped.values()] == [peers.target.incarnation]
        # Addressed to the old one (a target it gave before it restarted): refused.
        peers.data[:] = b"c" * SIZE
        with pytest.raises(PeerRestarted, match="restarted"):
            await source.write("target", WHOLE, incarnation=old)
        assert bytes(peers.target_kv) == b"b" * SIZE


async def test_a_caller_without_the_incarnation_reaches_the_restarted_peer_after_one_failure(
        ) -> None:
    """Over tcp the old process's address refuses the connection: that failure drops the
    kept descriptor, and the next transfer finds the new process (before, every later
    transfer failed too, until this engine restarted)."""
    async with Peers(("tcp",)) as peers:
        await peers.source.write("target", WHOLE)
        await peers.restart()
        peers.data[:] = b"c" * SIZE
        with pytest.raises(TransferFailed):
            await peers.source.write("target", WHOLE)
        await peers.source.write("target", WHOLE)
        assert bytes(peers.target_kv) == b"c" * SIZE
