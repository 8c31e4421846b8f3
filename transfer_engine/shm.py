"""The shared-memory transport: same host, one-sided.

The writer maps the peer's segment (POSIX shared memory, named in its descriptor) and copies
once; the receiver does no work for the bytes. Notifications then go over the TCP control
connection, after the copy returned, so they always follow their data. Reads copy the other
way. Mappings are cached per peer segment and released on close.
"""

from __future__ import annotations

import asyncio
import ctypes
from typing import NamedTuple

import numpy as np

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine.batch import Run, stripe
from transfer_engine.errors import TransferFailed
from transfer_engine.segment import Segment, SharedMemoryRegion, buffer_address
from transfer_engine.tcp import TcpTransport
from transfer_engine.transport import Plan

# Equal pieces up to this size are copied as numpy rows (see _copy_rows).
_ROW_COPY_MAX_BYTES = 16 << 10
# A copy runs on the event loop's thread a slice of at most this size at a time (~0.4 ms at
# 10 GB/s), with a turn of the loop between slices, so it never stalls the loop for longer;
# that costs less than handing it to a thread and back (0.15-0.25 ms here, paid by the
# transfer: a 1 MiB write took 236 us threaded, 84 us inline; 8 MiB moved at 68 % of memcpy
# threaded, 98 % inline).
_SLICE_BYTES = 4 << 20
# Copies above this size run in a worker thread (ctypes.memmove releases the GIL): the
# handoff is a few percent of them, and the loop stays free while they run.
_INLINE_COPY_BYTES = 32 << 20


class ShmTransport:
    name = "shm"
    is_one_sided = True

    def __init__(self, host_id: str, tcp: TcpTransport) -> None:
        self._host_id = host_id
        self._tcp = tcp
        self._mapped: dict[tuple[str, int], _Mapped] = {}
        self._superseded: list[_Mapped] = []  # of peers that restarted since
        self._num_copying = 0  # copies under way on the loop's thread
        self._copying: set[asyncio.Future[None]] = set()
        self._is_closed = False

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return peer.host_id == self._host_id and all(
            info.shm_name or info.mirror_shm_name for info in remote)

    async def write(self, plan: Plan) -> None:
        await self._copy(plan, is_write=True)
        mirrored = _into_mirrors(plan.runs)
        if plan.notifications or mirrored:
            await self._tcp.notify(plan.peer, plan.notifications, plan.timeout_s,
                                   written=mirrored)

    async def read(self, plan: Plan) -> None:
        mirrored = _into_mirrors(plan.runs)
        if mirrored:
            await self._tcp.stage(plan.peer, mirrored, plan.timeout_s)
        await self._copy(plan, is_write=False)

    async def _copy(self, plan: Plan, *, is_write: bool) -> None:
        self._num_copying += 1
        try:
            await self._copy_slices(plan, is_write=is_write)
        finally:
            self._num_copying -= 1
            self._unmap_superseded()

    async def _copy_slices(self, plan: Plan, *, is_write: bool) -> None:
        if plan.num_bytes <= _SLICE_BYTES:
            _copy_all(self._copies(plan.peer, plan.runs, is_write=is_write))
        elif plan.num_bytes <= _INLINE_COPY_BYTES:
            slices = stripe(plan.runs, -(-plan.num_bytes // _SLICE_BYTES))
            for index, runs in enumerate(slices):
                if index:
                    await asyncio.sleep(0)  # the loop's turn
                    if self._is_closed:  # our mappings are gone: no byte more
                        raise TransferFailed("transfer engine closed")
                _copy_all(self._copies(plan.peer, runs, is_write=is_write))
        else:
            # A thread's copy cannot be cancelled: track it so close() never unmaps under it.
            copies = self._copies(plan.peer, plan.runs, is_write=is_write)
            copying = asyncio.ensure_future(asyncio.to_thread(_copy_all, copies))
            self._copying.add(copying)
            copying.add_done_callback(self._copying.discard)
            await asyncio.shield(copying)

    def _copies(self, peer: TransferEndpoint, runs: list[Run], *,
                is_write: bool) -> list[Copy]:
        copies = []
        for run in runs:
            local, remote = run.local, self._map(peer, run.remote)
            if is_write:
                copies.append(Copy(local.data, local.address, remote.buffer, remote.address,
                                   run.local_offsets, run.remote_offsets, run.lengths))
            else:
                copies.append(Copy(remote.buffer, remote.address, local.data, local.address,
                                   run.remote_offsets, run.local_offsets, run.lengths))
        return copies

    def _map(self, peer: TransferEndpoint, info: SegmentInfo) -> _Mapped:
        """The peer's segment, mapped here (once per incarnation of the peer: one restarted
        under the same id has new memory, perhaps under the same name)."""
        key = (peer.engine_id, info.segment_id)
        mapped = self._mapped.get(key)
        if mapped is not None and mapped.incarnation != peer.incarnation:
            self._superseded.append(self._mapped.pop(key))  # unmapped once no copy runs
            mapped = None
        if mapped is None:
            shm_name = info.shm_name or info.mirror_shm_name
            if shm_name is None:
                raise TransferFailed(f"{peer.engine_id!r}'s segment {info.name!r} is not "
                                     "in shared memory")
            try:
                region = SharedMemoryRegion(shm_name, info.size_bytes, create=False)
            except OSError as error:
                raise TransferFailed(f"cannot map {peer.engine_id!r}'s segment "
                                     f"{info.name!r}: {error}") from error
            mapped = self._mapped[key] = _Mapped(region, region.buffer,
                                                 buffer_address(region.buffer),
                                                 peer.incarnation)
        return mapped

    def _unmap_superseded(self) -> None:
        """Unmap the segments of peers' earlier incarnations, unless a copy may still be
        using one (a write sliced across turns of the loop, or one in a thread)."""
        if self._superseded and not self._num_copying and not self._copying:
            for mapped in self._superseded:
                mapped.region.close()
            self._superseded.clear()

    def moves_in_place(self, segment: Segment) -> bool:
        return False  # device segments go through their mirrors

    async def close(self) -> None:
        self._is_closed = True
        await asyncio.gather(*self._copying, return_exceptions=True)
        for mapped in [*self._mapped.values(), *self._superseded]:
            mapped.region.close()
        self._mapped.clear()
        self._superseded.clear()


def _into_mirrors(runs: list[Run]) -> list[Run]:
    """The runs whose peer segment is a device's host mirror: the peer must move their
    pieces between mirror and device (told over tcp)."""
    return [run for run in runs if run.remote.shm_name is None]


class _Mapped(NamedTuple):
    """A peer's segment mapped into this process."""

    region: SharedMemoryRegion
    buffer: memoryview
    address: int
    incarnation: str  # the peer's, when mapped


class Copy(NamedTuple):
    """One run's pieces from `source` to `target` (whole segments and their addresses, byte
    offsets)."""

    source: memoryview
    source_address: int
    target: memoryview
    target_address: int
    source_offsets: np.ndarray
    target_offsets: np.ndarray
    lengths: np.ndarray


def _copy_all(copies: list[Copy]) -> None:
    for copy in copies:
        if not _copy_rows(copy):
            _copy_pieces(copy)


def _copy_rows(copy: Copy) -> bool:
    """Small equal pieces at multiples of their size (KV blocks): one vectorized gather and
    scatter, which beats a call per piece; False if the run is not of that shape."""
    if len(copy.lengths) < 16:
        return False
    size = int(copy.lengths[0])
    if size > _ROW_COPY_MAX_BYTES or (copy.lengths != size).any() \
            or (copy.source_offsets % size).any() or (copy.target_offsets % size).any():
        return False
    source = _rows(copy.source, size)
    target = _rows(copy.target, size)
    target[copy.target_offsets // size] = source[copy.source_offsets // size]
    return True


def _rows(data: memoryview, size: int) -> np.ndarray:
    """The segment as an array of `size`-byte opaque items: numpy then moves each piece with
    one memcpy (as uint8 rows it copies byte by byte, 2-3x slower)."""
    flat = np.frombuffer(data, dtype=np.uint8)
    return flat[:len(flat) - len(flat) % size].view(np.dtype((np.void, size)))


def _copy_pieces(copy: Copy) -> None:
    memmove = ctypes.memmove
    if len(copy.lengths) == 1:  # the common layer-sized piece: no array arithmetic
        memmove(copy.target_address + int(copy.target_offsets[0]),
                copy.source_address + int(copy.source_offsets[0]), int(copy.lengths[0]))
        return
    sources = (copy.source_address + copy.source_offsets).tolist()
    targets = (copy.target_address + copy.target_offsets).tolist()
    for source, target, length in zip(sources, targets, copy.lengths.tolist(), strict=True):
        memmove(target, source, length)
