"""This engine's registered memory: segments by name and id, and the bounds-checked views
that local transfers read from and peers' transfers land in."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from typing import Any

import numpy as np
import structlog

from shared.messages import SegmentInfo
from transfer_engine import wire
from transfer_engine.batch import check_ranges
from transfer_engine.errors import InvalidTransfer
from transfer_engine.segment import (
    SHM_DIR,
    Segment,
    SharedMemoryRegion,
    as_byte_view,
    check_bounds,
    is_device_tensor,
    shm_name_for,
)
from transfer_engine.staging import DeviceStaging

log = structlog.get_logger(__name__)

_SMALL_TABLE = 16  # fewer pieces than this are checked in a loop: numpy calls cost more


class LocalMemory:
    """The segment table. Ids are never reused, so a stale descriptor can never address a
    segment registered later under the same name."""

    def __init__(self, engine_id: str) -> None:
        self._engine_id = engine_id
        self._by_name: dict[str, Segment] = {}
        self._by_id: dict[int, Segment] = {}
        self._ids = itertools.count(1)
        self._regions: dict[str, SharedMemoryRegion] = {}
        self._staged: set[int] = set()  # ids of segments with device staging

    def register(self, name: str, buffer: Any, *, is_staged: bool | None = None) -> Segment:
        """Register `buffer` (bytes-like, numpy array, torch tensor) under `name`. A device
        tensor goes through a host mirror (`is_staged`, the default for them; a CPU tensor
        can be staged too, which is how the mirror logic is tested without a GPU)."""
        if is_staged or (is_staged is None and is_device_tensor(buffer)):
            if not hasattr(buffer, "is_contiguous") or not buffer.is_contiguous():
                raise InvalidTransfer("only a contiguous torch tensor can be staged")
            self._check_name(name)
            region = self._shared_mirror(name, buffer.numel() * buffer.element_size())
            try:
                staging = DeviceStaging(buffer, region.buffer if region is not None else None)
            except BaseException:
                if region is not None:
                    self._regions.pop(name).close()
                raise
            segment = self._add(name, staging.host, owner=buffer, staging=staging,
                                mirror_shm_name=region.name if region is not None else None)
            self._staged.add(segment.segment_id)
            return segment
        return self._add(name, as_byte_view(buffer), owner=buffer)

    def _shared_mirror(self, name: str, size_bytes: int) -> SharedMemoryRegion | None:
        """Shared memory for a staged segment's mirror (same-host peers then copy over shm);
        None, and a private mirror, where it would take more than half of the room left in
        /dev/shm (peers use tcp)."""
        if size_bytes <= 0:
            return None
        free = os.statvfs(SHM_DIR)
        if size_bytes > free.f_bavail * free.f_frsize // 2:
            log.info("transfer.mirror_not_shared", segment=name, size_bytes=size_bytes,
                     reason="/dev/shm has too little room")
            return None
        try:
            region = SharedMemoryRegion(shm_name_for(self._engine_id, next(self._ids)),
                                        size_bytes, create=True)
        except OSError as error:
            log.warning("transfer.mirror_not_shared", segment=name, size_bytes=size_bytes,
                        error=str(error))
            return None
        self._regions[name] = region
        return region

    def allocate(self, name: str, size_bytes: int) -> Segment:
        """Allocate `size_bytes` of shared memory and register it: same-host peers can then
        write into it one-sidedly. The segment's `data` is a writable memoryview."""
        if size_bytes <= 0:
            raise InvalidTransfer(f"cannot allocate {size_bytes} bytes")
        self._check_name(name)
        region = SharedMemoryRegion(shm_name_for(self._engine_id, next(self._ids)),
                                    size_bytes, create=True)
        self._regions[name] = region
        return self._add(name, region.buffer, owner=region, shm_name=region.name)

    def unregister(self, name: str) -> None:
        segment = self._by_name.pop(name, None)
        if segment is None:
            raise InvalidTransfer(f"no segment named {name!r}")
        del self._by_id[segment.segment_id]
        self._staged.discard(segment.segment_id)
        if segment.staging is not None:
            segment.staging.close()
        region = self._regions.pop(name, None)
        if region is not None:
            region.close()

    def _add(self, name: str, data: memoryview, **fields: Any) -> Segment:
        self._check_name(name)
        segment = Segment(name=name, segment_id=next(self._ids), data=data, **fields)
        self._by_name[name] = segment
        self._by_id[segment.segment_id] = segment
        return segment

    def _check_name(self, name: str) -> None:
        if name in self._by_name:
            raise InvalidTransfer(f"a segment named {name!r} is already registered")

    def get(self, name: str) -> Segment:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidTransfer(f"no local segment named {name!r}") from None

    def segments(self) -> list[Segment]:
        return list(self._by_name.values())

    def infos(self) -> list[SegmentInfo]:
        return [segment.info() for segment in self._by_name.values()]

    def views(self, table: bytes | memoryview, *, for_write: bool) -> list[memoryview]:
        """Views of the pieces a peer named (a wire piece table), in order;
        `InvalidTransfer` if any is not ours or out of bounds, and then none is touched."""
        if len(table) <= _SMALL_TABLE * wire.PIECE.size:
            return self._few_views(wire.PIECE.iter_unpack(table), for_write=for_write)
        table = wire.unpack_pieces(table)
        segment_ids = table["segment_id"]
        offsets = table["offset"].astype(np.int64)  # u8 values >= 2**63 turn negative: refused
        lengths = table["length"].astype(np.int64)
        segments = {}
        for segment_id in np.unique(segment_ids).tolist():
            segment = self._by_id.get(segment_id)
            if segment is None:
                raise InvalidTransfer(f"no segment with id {segment_id}")
            if for_write and not segment.is_writable:
                raise InvalidTransfer(f"segment {segment.name!r} is read-only")
            mine = segment_ids == segment_id
            check_ranges(segment.name, segment.size_bytes, offsets[mine], lengths[mine])
            segments[segment_id] = segment.data
        if len(segments) == 1:
            (data,) = segments.values()
            return [data[offset:offset + length]
                    for offset, length in zip(offsets.tolist(), lengths.tolist(), strict=True)]
        return [segments[segment_id][offset:offset + length] for segment_id, offset, length
                in zip(segment_ids.tolist(), offsets.tolist(), lengths.tolist(), strict=True)]

    @property
    def has_staged(self) -> bool:
        """Some segment goes through a host mirror: `landed` and `before_read` copy to or from
        a device (in a thread: a copy per piece and a wait for the device)."""
        return bool(self._staged)

    def landed(self, table: bytes | memoryview) -> None:
        """A peer's bytes are in these pieces: push staged ones to their device. Safe in a
        thread while the loop registers and unregisters segments."""
        if self._staged:
            self._stage(wire.unpack_pieces(table), to_device=True)

    def before_read(self, table: bytes | memoryview) -> None:
        """A peer is about to read these pieces: pull staged ones from their device (as
        `landed`, safe in a thread)."""
        if self._staged:
            self._stage(wire.unpack_pieces(table), to_device=False)

    def _stage(self, table: np.ndarray, *, to_device: bool) -> None:
        for segment_id in tuple(self._staged):
            mine = table["segment_id"] == segment_id
            segment = self._by_id.get(segment_id)
            if mine.any() and segment is not None:
                staging = segment.staging
                assert staging is not None  # invariant: _staged holds staged segments only
                move = staging.to_device if to_device else staging.to_host
                move(table["offset"][mine].astype(np.int64),
                     table["length"][mine].astype(np.int64))

    def view(self, segment_id: int, offset: int, length: int, *,
             for_write: bool) -> memoryview:
        """The view of one piece a peer named; `InvalidTransfer` if it is not ours or out of
        bounds."""
        segment = self._by_id.get(segment_id)
        if segment is None:
            raise InvalidTransfer(f"no segment with id {segment_id}")
        if for_write and not segment.is_writable:
            raise InvalidTransfer(f"segment {segment.name!r} is read-only")
        check_bounds(segment.name, segment.size_bytes, offset, length)
        return segment.data[offset:offset + length]

    def _few_views(self, pieces: Iterable[tuple[int, int, int]], *,
                   for_write: bool) -> list[memoryview]:
        return [self.view(segment_id, offset, length, for_write=for_write)
                for segment_id, offset, length in pieces]

    def close(self) -> None:
        """Release every shared-memory name this engine created."""
        for segment in self._by_name.values():
            if segment.staging is not None:
                segment.staging.close()
        for region in self._regions.values():
            region.close()
        self._regions.clear()
        self._by_name.clear()
        self._by_id.clear()
