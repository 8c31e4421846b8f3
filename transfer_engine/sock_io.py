"""Vectored, zero-copy socket I/O on a non-blocking socket, awaited on any asyncio loop.

asyncio has `sock_recv_into` for one buffer; a transfer lands in many (one per piece), so
these helpers call `recvmsg_into` / `sendmsg` with the whole list of views and wait for
readiness only when the kernel would block. No byte is copied in user space.
"""

from __future__ import annotations

import asyncio
import os
import socket

# Linux caps one sendmsg/recvmsg at IOV_MAX (1024) buffers.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before the expected bytes arrived."""


async def recv_into(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view, in order, from `sock`."""
    views = [v for v in views if v.nbytes]
    while views:
        try:
            received = sock.recvmsg_into(views[:_IOV_MAX])[0]
        except (BlockingIOError, InterruptedError):
            await _ready(sock, is_write=False)
            continue
        if received == 0:
            raise ConnectionClosed("peer closed the connection")
        views = _advance(views, received)


async def send(sock: socket.socket, views: list[memoryview | bytes]) -> None:
    """Send every view, in order, on `sock`."""
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        try:
            sent = sock.sendmsg(pending[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            await _ready(sock, is_write=True)
            continue
        pending = _advance(pending, sent)


def _advance(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    index = 0
    while index < len(views) and num_bytes >= views[index].nbytes:
        num_bytes -= views[index].nbytes
        index += 1
    rest = views[index:]
    if num_bytes:
        rest[0] = rest[0][num_bytes:]
    return rest


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
