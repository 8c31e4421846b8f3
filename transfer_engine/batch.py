"""What a transfer is made of: pieces, their coalescing, and the result of a transfer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class TransferPiece(NamedTuple):
    """Move `length` bytes between `local_segment[local_offset:]` and the peer's
    `remote_segment[remote_offset:]` (direction set by `write` or `read`)."""

    local_segment: str
    local_offset: int
    remote_segment: str
    remote_offset: int
    length: int


@dataclass(frozen=True)
class TransferResult:
    """What one `write`/`read` did: payload bytes, wall seconds, the transport that carried it,
    how many pieces remained after coalescing, and the compression applied on the wire (None
    when the bytes moved as they are, as shared memory always moves them)."""

    num_bytes: int
    seconds: float
    transport: str
    num_pieces: int
    compression: str | None = None

    @property
    def gbytes_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Notification:
    """A message a writer attached to a transfer; delivered after that transfer's bytes
    landed in this engine's memory."""

    peer_id: str
    payload: bytes


def coalesce(pieces: list[TransferPiece]) -> list[TransferPiece]:
    """Merge pieces that are contiguous on both sides into one; drop empty pieces. Order is
    kept otherwise, so a caller's batch with overlapping targets lands as written."""
    merged: list[TransferPiece] = []
    for piece in pieces:
        if piece.length == 0:
            continue
        if merged and _continues(merged[-1], piece):
            last = merged[-1]
            merged[-1] = last._replace(length=last.length + piece.length)
        else:
            merged.append(piece)
    return merged


def _continues(last: TransferPiece, piece: TransferPiece) -> bool:
    return (piece.local_segment == last.local_segment
            and piece.remote_segment == last.remote_segment
            and piece.local_offset == last.local_offset + last.length
            and piece.remote_offset == last.remote_offset + last.length)
