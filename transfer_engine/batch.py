"""What a transfer is made of: pieces, runs of pieces as arrays, and the result.

A caller names pieces as `TransferPiece` tuples, or, for thousands of KV blocks at once, as a
`PieceArrays` (numpy offsets and lengths between one local and one remote segment). Either
way the engine turns them into `Run`s: numpy arrays, coalesced and bounds-checked with a few
vector operations, so planning a 1,000-piece batch costs microseconds, not a Python loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import numpy as np

from transfer_engine.errors import InvalidTransfer
from transfer_engine.segment import check_bounds

# Below this many pieces, plain Python loops beat numpy's per-call overhead.
_SMALL_BATCH = 16
_INT64 = np.dtype(np.int64)

if TYPE_CHECKING:
    from shared.messages import SegmentInfo, TransferEndpoint
    from transfer_engine.segment import Segment
    from transfer_engine.transport import Transport


class TransferPiece(NamedTuple):
    """Move `length` bytes between `local_segment[local_offset:]` and the peer's
    `remote_segment[remote_offset:]` (direction set by `write` or `read`)."""

    local_segment: str
    local_offset: int
    remote_segment: str
    remote_offset: int
    length: int


@dataclass(frozen=True)
class PieceArrays:
    """Many pieces between one local and one remote segment, as equal-length integer arrays."""

    local_segment: str
    remote_segment: str
    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    lengths: np.ndarray


class TransferResult(msgspec.Struct, frozen=True):
    """What one `write`/`read` did: payload bytes, wall seconds, the transport that carried it,
    how many pieces remained after coalescing, the compression applied on the wire (None
    when the bytes moved as they are, as shared memory always moves them), and the bytes that
    crossed (scales and codes when compressed; else `num_bytes`)."""

    num_bytes: int
    seconds: float
    transport: str
    num_pieces: int
    compression: str | None = None
    wire_bytes: int = 0


@dataclass(frozen=True)
class Notification:
    """A message a writer attached to a transfer; delivered after that transfer's bytes
    landed in this engine's memory."""

    peer_id: str
    payload: bytes


@dataclass(slots=True)
class Run:
    """Checked pieces between one local segment and one remote segment (int64 arrays).
    Not changed once made (not frozen: a frozen dataclass costs 4x to build, on every
    transfer)."""

    local: Segment
    remote: SegmentInfo
    local_offsets: np.ndarray
    remote_offsets: np.ndarray
    lengths: np.ndarray
    num_bytes: int = field(default=-1, repr=False, compare=False)  # the lengths' sum

    def __post_init__(self) -> None:
        if self.num_bytes < 0:
            lengths = self.lengths
            self.num_bytes = sum(lengths.tolist()) if len(
                lengths) <= _SMALL_BATCH else int(lengths.sum())

    @property
    def num_pieces(self) -> int:
        return len(self.lengths)

    def local_views(self) -> list[memoryview]:
        data = self.local.data
        return [data[offset:offset + length] for offset, length
                in zip(self.local_offsets.tolist(), self.lengths.tolist(), strict=True)]

    def take(self, start: int, stop: int) -> Run:
        return Run(self.local, self.remote, self.local_offsets[start:stop],
                   self.remote_offsets[start:stop], self.lengths[start:stop])


@dataclass(frozen=True)
class Route:
    """A peer's segment as seen from one of ours: the peer's descriptor, both segments, and the
    transports that reach it (in preference order). Resolved once per pair of segments."""

    endpoint: TransferEndpoint
    local: Segment
    remote: SegmentInfo
    candidates: list[Transport]

    def plan(self, pieces: PieceArrays, *, is_read: bool) -> Run | None:
        """The pieces coalesced and bounds-checked on both sides; None if nothing moves."""
        local, remote = self.local, self.remote
        if is_read and not local.is_writable:
            raise InvalidTransfer(f"segment {local.name!r} is read-only")
        if _is_one_int64_piece(pieces):  # a layer-sized piece, the common case: no numpy calls
            (local_offset,), (remote_offset,), (length,) = (
                pieces.local_offsets.tolist(), pieces.remote_offsets.tolist(),
                pieces.lengths.tolist())
            check_bounds(local.name, local.size_bytes, local_offset, length)
            check_bounds(remote.name, remote.size_bytes, remote_offset, length)
            return Run(local, remote, pieces.local_offsets, pieces.remote_offsets,
                       pieces.lengths, length) if length else None
        local_offsets, remote_offsets, lengths = coalesce(
            *(np.asarray(numbers, dtype=np.int64) for numbers in (
                pieces.local_offsets, pieces.remote_offsets, pieces.lengths)))
        check_ranges(local.name, local.size_bytes, local_offsets, lengths)
        check_ranges(remote.name, remote.size_bytes, remote_offsets, lengths)
        return Run(local, remote, local_offsets, remote_offsets, lengths) if len(
            lengths) else None


def _is_one_int64_piece(pieces: PieceArrays) -> bool:
    local, remote, lengths = pieces.local_offsets, pieces.remote_offsets, pieces.lengths
    return (type(local) is np.ndarray and type(remote) is np.ndarray
            and type(lengths) is np.ndarray and local.dtype is _INT64
            and remote.dtype is _INT64 and lengths.dtype is _INT64
            and local.shape == remote.shape == lengths.shape == (1,))


def group(batch: object) -> list[PieceArrays]:
    """Split a batch of `TransferPiece`s (or one `PieceArrays`) into arrays per pair of
    segments, keeping the pieces' order within each pair."""
    if isinstance(batch, PieceArrays):
        return [batch]
    pieces: list[tuple[str, int, str, int, int]] = list(batch)  # type: ignore[call-overload]
    if not pieces:
        return []
    if any(len(piece) != 5 for piece in pieces):
        raise InvalidTransfer("a piece is (local segment, local offset, remote segment, "
                              "remote offset, length)")
    names = [(piece[0], piece[2]) for piece in pieces]
    numbers = np.array([(piece[1], piece[3], piece[4]) for piece in pieces])
    if numbers.dtype.kind not in "iu" or numbers.ndim != 2:
        raise InvalidTransfer("offsets and lengths must be integers that fit in 64 bits")
    numbers = numbers.astype(np.int64)
    groups = []
    for local, remote in dict.fromkeys(names):
        mine = np.array([name == (local, remote) for name in names]) if len(
            set(names)) > 1 else slice(None)
        groups.append(PieceArrays(local, remote, numbers[mine, 0], numbers[mine, 1],
                                  numbers[mine, 2]))
    return groups


def coalesce(local_offsets: np.ndarray, remote_offsets: np.ndarray,
             lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Drop empty pieces and merge each piece into the one before it when both sides are
    contiguous. Order is kept, so overlapping targets land as listed."""
    if len(lengths) == 1:
        return (local_offsets, remote_offsets, lengths) if lengths[0] else (
            local_offsets[:0], remote_offsets[:0], lengths[:0])
    keep = lengths != 0
    if not keep.all():
        local_offsets, remote_offsets, lengths = (local_offsets[keep], remote_offsets[keep],
                                                  lengths[keep])
    if len(lengths) < 2:
        return local_offsets, remote_offsets, lengths
    ends_local = local_offsets[:-1] + lengths[:-1]
    joins = (ends_local == local_offsets[1:]) & (
        remote_offsets[:-1] + lengths[:-1] == remote_offsets[1:])
    if not joins.any():
        return local_offsets, remote_offsets, lengths
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return local_offsets[starts], remote_offsets[starts], np.add.reduceat(lengths, starts)


def check_ranges(name: str, size_bytes: int, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """`InvalidTransfer` naming the first piece outside `[0, size_bytes)`."""
    if len(lengths) <= _SMALL_BATCH:  # a few numpy calls cost more than a short loop
        for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True):
            check_bounds(name, size_bytes, offset, length)
        return
    # Written so that no sum can overflow int64 (a peer controls these numbers).
    bad = (offsets < 0) | (lengths < 0) | (offsets > size_bytes) | (lengths > size_bytes - offsets)
    if bad.any():
        index = int(np.argmax(bad))
        start, length = int(offsets[index]), int(lengths[index])
        raise InvalidTransfer(f"piece [{start}, {start + length}) is outside segment {name!r} "
                              f"of {size_bytes} bytes")


def stripe(runs: list[Run], num_parts: int) -> list[list[Run]]:
    """Cut runs into up to `num_parts` parts of about equal bytes (splitting a piece where a
    boundary falls inside it): one part per connection."""
    total = sum(run.num_bytes for run in runs)
    if num_parts <= 1 or total == 0:
        return [runs]
    target = -(-total // num_parts)
    if sum(run.num_pieces for run in runs) <= _SMALL_BATCH:
        return _stripe_few(runs, target)
    parts: list[list[Run]] = [[] for _ in range(num_parts)]
    for run, start_byte in _with_start_bytes(runs):
        ends = start_byte + np.cumsum(run.lengths)
        starts = ends - run.lengths
        for part in range(int(starts[0] // target), int((ends[-1] - 1) // target) + 1):
            low, high = part * target, (part + 1) * target
            cut_start = np.clip(low - starts, 0, run.lengths)
            cut_end = np.clip(high - starts, 0, run.lengths)
            inside = cut_end > cut_start
            if inside.any():
                parts[part].append(Run(run.local, run.remote,
                                       (run.local_offsets + cut_start)[inside],
                                       (run.remote_offsets + cut_start)[inside],
                                       (cut_end - cut_start)[inside]))
    return [part for part in parts if part]


def _stripe_few(runs: list[Run], target: int) -> list[list[Run]]:
    """`stripe` for a handful of pieces, in plain Python (numpy calls cost more here)."""
    parts: list[list[tuple[Run, int, int, int]]] = [[]]
    room = target
    for run in runs:
        for local, remote, length in zip(run.local_offsets.tolist(), run.remote_offsets.tolist(),
                                         run.lengths.tolist(), strict=True):
            while length > room:
                if room:
                    parts[-1].append((run, local, remote, room))
                    local, remote, length = local + room, remote + room, length - room
                parts.append([])
                room = target
            parts[-1].append((run, local, remote, length))
            room -= length
    return [[Run(run.local, run.remote, np.array([local]), np.array([remote]),
                 np.array([length])) for run, local, remote, length in part]
            for part in parts if part]


def _with_start_bytes(runs: list[Run]) -> Iterator[tuple[Run, int]]:
    start = 0
    for run in runs:
        if run.num_pieces:
            yield run, start
            start += run.num_bytes
