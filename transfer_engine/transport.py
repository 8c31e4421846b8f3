"""The protocol every transport implements, and the plan it is handed.

The engine resolves a batch before a transport sees it: pieces are coalesced, local views are
bounds-checked, remote pieces are checked against the peer's descriptor. A transport only
moves bytes and reports failures as `TransferFailed` / `TransferTimeout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine.wire import Compression


@dataclass(frozen=True)
class PlannedPiece:
    local: memoryview
    remote: SegmentInfo
    remote_offset: int

    @property
    def length(self) -> int:
        return self.local.nbytes

    @property
    def wire(self) -> tuple[int, int, int]:
        return (self.remote.segment_id, self.remote_offset, self.local.nbytes)


@dataclass(frozen=True)
class Plan:
    """A resolved transfer to one peer."""

    peer: TransferEndpoint
    pieces: list[PlannedPiece]
    notifications: list[bytes]
    compression: Compression | None
    timeout_s: float

    @property
    def num_bytes(self) -> int:
        return sum(piece.length for piece in self.pieces)


# How a transport hands inbound notifications to the engine: (peer id, payloads).
Deliver = Callable[[str, list[bytes]], None]


class Transport(Protocol):
    name: str

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        """Whether this transport can carry a transfer to these segments of `peer`."""

    async def write(self, plan: Plan) -> None:
        """Land every piece's local bytes in the peer's memory, then its notifications; return
        once the peer has them. Raise `TransferFailed` or `TransferTimeout`."""

    async def read(self, plan: Plan) -> None:
        """Fill every piece's local view from the peer's memory."""

    async def close(self) -> None:
        """Release every socket, mapping and handle; idempotent."""
