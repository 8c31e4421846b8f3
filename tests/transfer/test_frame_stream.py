"""The callback-driven connection under the TCP transport, on a real socket pair: bytes land
in the expected views in order, steps run as their views fill, a pause holds what follows,
and a raised receive low-water mark never strands the last bytes of a payload."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest

from transfer_engine import frame_stream, sock_io
from transfer_engine.frame_stream import FrameStream


@pytest.fixture
def sockets() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP connection over loopback (unix sockets ignore the low-water mark in poll)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        theirs = socket.create_connection(listener.getsockname())
        ours, _ = listener.accept()
    ours.setblocking(False)
    theirs.setblocking(False)
    yield ours, theirs
    ours.close()
    theirs.close()


class Recorder(FrameStream):
    """Expects the given sizes one step after another and records what each step got."""

    def __init__(self, sock: socket.socket, steps: list[list[int]]) -> None:
        super().__init__(sock)
        self.steps = steps
        self.received: list[bytes] = []
        self.done = asyncio.Event()

    def begin(self) -> None:
        self._next()
        self.start()

    def _next(self) -> None:
        if not self.steps:
            self.done.set()
            return
        views = [memoryview(bytearray(size)) for size in self.steps.pop(0)]
        self.expect(views, lambda: self._got(views))

    def _got(self, views: list[memoryview]) -> None:
        self.received.append(b"".join(bytes(view) for view in views))
        self._next()


async def test_small_steps_that_arrive_together_each_get_their_bytes(
        sockets: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = sockets
    stream = Recorder(ours, [[4], [0, 3], [5]])
    stream.begin()
    await sock_io.send(theirs, [b"headabcvwxyz"])
    await asyncio.wait_for(stream.done.wait(), 5)
    assert stream.received == [b"head", b"abc", b"vwxyz"]
    stream.abort()


async def test_a_payload_in_two_bursts_read_two_batches_per_wake_lands_whole(
        sockets: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """The low-water mark goes up for the payload after the first burst; reads that stop at
    the per-wake limit must still bring it down with what the payload needs (the transfer
    benchmark's 1,000 x 64 KiB batch hung on that; this test does not always reach that
    interleaving, the benchmark did in 2 of 4 runs)."""
    monkeypatch.setattr(frame_stream, "_READS_PER_WAKE", 2)
    ours, theirs = sockets
    sizes = [64 << 10] * 48 + [100]
    stream = Recorder(ours, [[32], sizes])
    stream.begin()
    payload = os.urandom(32 + sum(sizes))
    await sock_io.send(theirs, [payload[:100_000]])
    await asyncio.sleep(0.1)  # drained: the mark goes up to 1 MiB for the 3 MiB to come
    await sock_io.send(theirs, [payload[100_000:]])
    await asyncio.wait_for(stream.done.wait(), 5)
    assert b"".join(stream.received) == payload
    stream.abort()


async def test_a_pause_holds_the_next_step_until_resumed(
        sockets: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = sockets
    stream = Recorder(ours, [[2], [2]])
    first_step = stream._got

    def pause_after_first(views: list[memoryview]) -> None:
        stream._got = first_step  # type: ignore[method-assign]
        stream.pause()
        first_step(views)

    stream._got = pause_after_first  # type: ignore[method-assign]
    stream.begin()
    await sock_io.send(theirs, [b"ab", b"cd"])
    await asyncio.sleep(0.1)
    assert stream.received == [b"ab"]
    stream.resume()
    await asyncio.wait_for(stream.done.wait(), 5)
    assert stream.received == [b"ab", b"cd"]
    stream.abort()


async def test_output_the_kernel_cannot_take_yet_is_queued_and_sent_in_order(
        sockets: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = sockets
    stream = Recorder(ours, [])
    stream.begin()
    parts = [os.urandom(1 << 20) for _ in range(8)]  # more than the kernel buffers at once
    stream.send([memoryview(part) for part in parts])
    received = bytearray(8 << 20)
    await sock_io.recv_into(theirs, [memoryview(received)])
    assert bytes(received) == b"".join(parts)
    stream.abort()
