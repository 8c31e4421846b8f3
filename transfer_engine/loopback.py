"""The loopback transport: engines in one process hand bytes to each other directly.

It implements the real `Transport` protocol with in-process copies, so the conformance suite
and service tests can run the whole transfer API without sockets. Compression is applied and
undone as on a wire, so its error shows here too.
"""

from __future__ import annotations

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine import compression
from transfer_engine.errors import TransferFailed
from transfer_engine.memory import LocalMemory
from transfer_engine.transport import Deliver, Plan

_HUB: dict[str, tuple[LocalMemory, Deliver]] = {}


class LoopbackTransport:
    name = "loopback"

    def __init__(self, engine_id: str, memory: LocalMemory, deliver: Deliver) -> None:
        self._engine_id = engine_id
        _HUB[engine_id] = (memory, deliver)

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return peer.engine_id in _HUB

    async def write(self, plan: Plan) -> None:
        memory, deliver = self._peer(plan.peer)
        targets = memory.views([piece.wire for piece in plan.pieces], for_write=True)
        for piece, target in zip(plan.pieces, targets, strict=True):
            if plan.compression is None:
                target[:] = piece.local
            else:
                wire_bytes = compression.compress(piece.local, plan.compression)
                compression.decompress_into(memoryview(wire_bytes), plan.compression, target)
        deliver(self._engine_id, plan.notifications)

    async def read(self, plan: Plan) -> None:
        memory, _ = self._peer(plan.peer)
        sources = memory.views([piece.wire for piece in plan.pieces], for_write=False)
        for piece, source in zip(plan.pieces, sources, strict=True):
            piece.local[:] = source

    def _peer(self, peer: TransferEndpoint) -> tuple[LocalMemory, Deliver]:
        try:
            return _HUB[peer.engine_id]
        except KeyError:
            raise TransferFailed(f"{peer.engine_id!r} is not in this process") from None

    async def close(self) -> None:
        _HUB.pop(self._engine_id, None)
