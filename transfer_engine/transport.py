"""The protocol every transport implements, and the plan it is handed.

The engine resolves a batch before a transport sees it: pieces are coalesced into runs and
bounds-checked on both sides (the remote side against the peer's descriptor). A transport only
moves bytes and reports failures as `TransferFailed` / `TransferTimeout`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine.batch import Run
from transfer_engine.segment import Segment
from transfer_engine.wire import Compression


@dataclass(slots=True)
class Plan:
    """A resolved transfer to one peer (not changed once made; see `Run`)."""

    peer: TransferEndpoint
    runs: list[Run]
    notifications: list[bytes]
    compression: Compression | None
    timeout_s: float
    num_bytes: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        runs = self.runs
        self.num_bytes = runs[0].num_bytes if len(runs) == 1 else sum(
            run.num_bytes for run in runs)

    @property
    def num_pieces(self) -> int:
        runs = self.runs
        return runs[0].num_pieces if len(runs) == 1 else sum(run.num_pieces for run in runs)


# How a transport hands inbound notifications to the engine: (peer id, payloads).
Deliver = Callable[[str, list[bytes]], None]


class Transport(Protocol):
    name: str
    # One-sided transports land bytes with no receiver CPU; nothing there could dequantize,
    # so they move payloads as they are and ignore compression.
    is_one_sided: bool

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        """Whether this transport can carry a transfer to these segments of `peer`."""

    def write(self, plan: Plan) -> Awaitable[None]:
        """Land every piece's local bytes in the peer's memory, then its notifications; done
        once the peer has them. Raise `TransferFailed` or `TransferTimeout`. (An `async def`
        will do; tcp returns its answer's future, with no coroutine per transfer.)"""

    def read(self, plan: Plan) -> Awaitable[None]:
        """Fill every piece's local view from the peer's memory."""

    def moves_in_place(self, segment: Segment) -> bool:
        """Whether it reads and writes this local device segment (a staged one) in place;
        else it moves the segment's pinned host mirror, which the engine fills before a
        write and empties into the device after a read."""

    async def close(self) -> None:
        """Release every socket, mapping and handle; idempotent."""
