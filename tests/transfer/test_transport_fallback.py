"""A transfer that fails on one transport is tried once more on the next one the pair can
use; what is wrong with the batch itself is not retried."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from shared.messages import SegmentInfo, TransferEndpoint
from tests.transfer.conftest import SEGMENT_BYTES, Pair, start_pair
from transfer_engine.errors import InvalidTransfer, TransferFailed
from transfer_engine.segment import Segment
from transfer_engine.transport import Plan


class BrokenTransport:
    """Implements `Transport`: reaches every peer, and every transfer on it fails."""

    name = "broken"
    is_one_sided = True

    def __init__(self, error: TransferFailed) -> None:
        self.error = error
        self.num_attempts = 0

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return True

    async def write(self, plan: Plan) -> None:
        self.num_attempts += 1
        raise self.error

    async def read(self, plan: Plan) -> None:
        await self.write(plan)

    def moves_in_place(self, segment: Segment) -> bool:
        return False

    async def close(self) -> None:
        return None


@pytest.fixture
async def shm_pair() -> AsyncIterator[Pair]:
    running = await start_pair("shm")
    yield running
    await running.source.close()
    await running.target.close()


def put_first(pair: Pair, transport: BrokenTransport) -> None:
    pair.source._transports.insert(0, transport)  # preferred over shm and tcp


async def test_a_failed_transfer_lands_on_the_next_transport(shm_pair: Pair) -> None:
    broken = BrokenTransport(TransferFailed("simulated: the mapping is gone"))
    put_first(shm_pair, broken)
    shm_pair.source_kv[:8] = b"12345678"
    result = await shm_pair.source.write(shm_pair.target.config.engine_id,
                                         [("kv", 0, "kv", 64, 8)])
    assert (broken.num_attempts, result.transport) == (1, "shm")
    assert bytes(shm_pair.target_kv[64:72]) == b"12345678"


async def test_a_bad_batch_is_not_retried(shm_pair: Pair) -> None:
    broken = BrokenTransport(InvalidTransfer("simulated: out of bounds"))
    put_first(shm_pair, broken)
    with pytest.raises(InvalidTransfer, match="simulated"):
        await shm_pair.source.write(shm_pair.target.config.engine_id,
                                    [("kv", 0, "kv", 0, SEGMENT_BYTES)])
    assert broken.num_attempts == 1


async def test_only_one_retry_is_made(shm_pair: Pair) -> None:
    first, second = (BrokenTransport(TransferFailed("simulated")) for _ in range(2))
    put_first(shm_pair, second)
    put_first(shm_pair, first)
    with pytest.raises(TransferFailed, match="simulated"):
        await shm_pair.source.write(shm_pair.target.config.engine_id, [("kv", 0, "kv", 0, 8)])
    assert (first.num_attempts, second.num_attempts) == (1, 1)
