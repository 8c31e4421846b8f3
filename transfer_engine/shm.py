"""The shared-memory transport: same host, one-sided.

The writer maps the peer's segment (POSIX shared memory, named in its descriptor) and copies
once; the receiver does no work for the bytes. Notifications then go over the TCP control
connection, after the copy returned, so they always follow their data. Reads copy the other
way. Mappings are cached per peer segment and released on close.
"""

from __future__ import annotations

import asyncio
import ctypes

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine.errors import TransferFailed
from transfer_engine.segment import SharedMemoryRegion, buffer_address
from transfer_engine.tcp import TcpTransport
from transfer_engine.transport import Plan

# Copies above this size run in a worker thread (ctypes.memmove releases the GIL), so a large
# transfer never stalls the event loop.
_INLINE_COPY_BYTES = 256 << 10


class ShmTransport:
    name = "shm"

    def __init__(self, host_id: str, tcp: TcpTransport) -> None:
        self._host_id = host_id
        self._tcp = tcp
        self._mapped: dict[tuple[str, int], tuple[SharedMemoryRegion, int]] = {}
        self._copying: set[asyncio.Future[None]] = set()

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return peer.host_id == self._host_id and all(info.shm_name for info in remote)

    async def write(self, plan: Plan) -> None:
        copies = [(self._map(plan.peer, piece.remote) + piece.remote_offset, piece.local, True)
                  for piece in plan.pieces]
        await self._copy(copies, plan.num_bytes)
        if plan.notifications:
            await self._tcp.notify(plan.peer, plan.notifications, plan.timeout_s)

    async def read(self, plan: Plan) -> None:
        copies = [(self._map(plan.peer, piece.remote) + piece.remote_offset, piece.local, False)
                  for piece in plan.pieces]
        await self._copy(copies, plan.num_bytes)

    async def _copy(self, copies: list[Copy], num_bytes: int) -> None:
        if num_bytes <= _INLINE_COPY_BYTES:
            _copy_all(copies)
            return
        # A thread's copy cannot be cancelled: track it so close() never unmaps under it.
        copying = asyncio.ensure_future(asyncio.to_thread(_copy_all, copies))
        self._copying.add(copying)
        copying.add_done_callback(self._copying.discard)
        await asyncio.shield(copying)

    def _map(self, peer: TransferEndpoint, info: SegmentInfo) -> int:
        """The address at which the peer's segment is mapped here (mapping it once)."""
        key = (peer.engine_id, info.segment_id)
        mapped = self._mapped.get(key)
        if mapped is None:
            if info.shm_name is None:
                raise TransferFailed(f"{peer.engine_id!r}'s segment {info.name!r} is not "
                                     "in shared memory")
            try:
                region = SharedMemoryRegion(info.shm_name, info.size_bytes, create=False)
            except OSError as error:
                raise TransferFailed(f"cannot map {peer.engine_id!r}'s segment "
                                     f"{info.name!r}: {error}") from error
            mapped = self._mapped[key] = (region, buffer_address(region.buffer))
        return mapped[1]

    def forget(self, engine_id: str) -> None:
        """Unmap a peer's segments (it left, or re-registered its memory)."""
        for key in [key for key in self._mapped if key[0] == engine_id]:
            self._mapped.pop(key)[0].close()

    async def close(self) -> None:
        await asyncio.gather(*self._copying, return_exceptions=True)
        for region, _ in self._mapped.values():
            region.close()
        self._mapped.clear()


Copy = tuple[int, memoryview, bool]  # (remote address, local view, is_write)


def _copy_all(copies: list[Copy]) -> None:
    for remote, local, is_write in copies:
        here = buffer_address(local)
        if is_write:
            ctypes.memmove(remote, here, local.nbytes)
        else:
            ctypes.memmove(here, remote, local.nbytes)
