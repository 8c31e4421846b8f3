"""Vectored, zero-copy socket I/O on a non-blocking socket, awaited on any asyncio loop: the
handshake's few messages (connections then run as `frame_stream.FrameStream`), and the
batching helpers both use.

`recv_into` / `send` call `recvmsg_into` / `sendmsg` with the whole list of views and wait
for readiness only when the kernel would block. No byte is copied in user space.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

_BATCH_BYTES = 512 << 10

# Linux caps one sendmsg/recvmsg at IOV_MAX (1024) buffers.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before the expected bytes arrived."""


async def recv_into(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view (byte-format memoryviews), in order, from `sock`."""
    pending = [view for view in views if view.nbytes]
    index = 0
    while index < len(pending):
        batch, _ = next_batch(pending, index)
        try:
            received = sock.recvmsg_into(batch)[0]
        except (BlockingIOError, InterruptedError):
            await _ready(sock, is_write=False)
            continue
        if received == 0:
            raise ConnectionClosed("peer closed the connection")
        index = advance(pending, index, batch, received)


async def recv_bytes(sock: socket.socket, num_bytes: int) -> bytes:
    """Exactly `num_bytes` from `sock` (headers, tables: small things)."""
    buffer = bytearray(num_bytes)
    await recv_into(sock, [memoryview(buffer)])
    return bytes(buffer)


async def send(sock: socket.socket, views: list[memoryview | bytes]) -> None:
    """Send every buffer (bytes or byte-format memoryviews), in order, on `sock`."""
    pending = [view for view in views if len(view)]
    index = send_available(sock, pending)
    while index < len(pending):
        await _ready(sock, is_write=True)
        index = send_available(sock, pending, index)


def send_available(sock: socket.socket, pending: list, index: int = 0) -> int:
    """Send from `pending[index:]` what the kernel takes now, without waiting; return the
    index of the first buffer still to go (the one it stopped inside is trimmed)."""
    try:
        while index < len(pending):
            batch, _ = next_batch(pending, index)
            index = advance(pending, index, batch, sock.sendmsg(batch))
    except (BlockingIOError, InterruptedError):
        pass
    return index


def abort(sock: socket.socket) -> None:
    """Shut the connection down (waking any thread blocked on it), then close it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def next_batch(pending: list, index: int) -> tuple[list, int]:
    """The buffers for one syscall, and their bytes: at most IOV_MAX, and no more than about
    _BATCH_BYTES. Python acquires every buffer it passes, on every call; passing a thousand
    small pieces when the socket holds a few of them would cost more than the copy."""
    stop = min(len(pending), index + _IOV_MAX)
    num_bytes = 0
    for position in range(index, stop):
        num_bytes += len(pending[position])
        if num_bytes >= _BATCH_BYTES:
            return pending[index:position + 1], num_bytes
    return pending[index:stop], num_bytes


def advance(pending: list, index: int, batch: list, num_bytes: int) -> int:
    """Skip the buffers of `batch` (= pending[index:]) that `num_bytes` covered; trim the
    one it ended inside. Returns the index of the first buffer still to go."""
    for buffer in batch:
        size = len(buffer)
        if num_bytes < size:
            if num_bytes:
                pending[index] = memoryview(buffer)[num_bytes:]
            break
        num_bytes -= size
        index += 1
    return index


async def _ready(sock: socket.socket, *, is_write: bool) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sock.fileno()
    if fd < 0:
        raise ConnectionClosed("socket closed")

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    if is_write:
        loop.add_writer(fd, wake)
    else:
        loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        if is_write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
