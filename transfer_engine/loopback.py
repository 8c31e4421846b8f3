"""The loopback transport: engines in one process hand bytes to each other directly.

It implements the real `Transport` protocol with in-process copies, so the conformance suite
and service tests can run the whole transfer API without sockets. Compression is applied and
undone as on a wire, so its error shows here too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine import compression, wire
from transfer_engine.errors import TransferFailed
from transfer_engine.memory import LocalMemory
from transfer_engine.segment import Segment
from transfer_engine.transport import Deliver, Plan

_HUB: dict[str, tuple[LocalMemory, Deliver]] = {}


class LoopbackTransport:
    name = "loopback"
    is_one_sided = False

    def __init__(self, engine_id: str, memory: LocalMemory, deliver: Deliver) -> None:
        self._engine_id = engine_id
        _HUB[engine_id] = (memory, deliver)

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return peer.engine_id in _HUB

    async def write(self, plan: Plan) -> None:
        memory, deliver = self._peer(plan.peer)
        table = wire.table_of(plan.runs)
        targets = memory.views(table, for_write=True)
        sources = [view for run in plan.runs for view in run.local_views()]
        for source, target in zip(sources, targets, strict=True):
            if plan.compression is None:
                target[:] = source
            else:
                wire_bytes = compression.compress(source, plan.compression)
                compression.decompress_into(memoryview(wire_bytes), plan.compression, target)
        await _off_loop(memory, memory.landed, table)
        deliver(self._engine_id, plan.notifications)

    async def read(self, plan: Plan) -> None:
        memory, _ = self._peer(plan.peer)
        table = wire.table_of(plan.runs)
        sources = memory.views(table, for_write=False)
        await _off_loop(memory, memory.before_read, table)
        targets = [view for run in plan.runs for view in run.local_views()]
        for source, target in zip(sources, targets, strict=True):
            target[:] = source

    def _peer(self, peer: TransferEndpoint) -> tuple[LocalMemory, Deliver]:
        try:
            return _HUB[peer.engine_id]
        except KeyError:
            raise TransferFailed(f"{peer.engine_id!r} is not in this process") from None

    def moves_in_place(self, segment: Segment) -> bool:
        return False  # device segments go through their mirrors

    async def close(self) -> None:
        _HUB.pop(self._engine_id, None)


async def _off_loop(memory: LocalMemory, stage: Callable[[bytes], None], table: bytes) -> None:
    """Staged pieces to or from their device in a thread, as the tcp server moves them."""
    if memory.has_staged:
        await asyncio.to_thread(stage, table)
