"""One authenticated TCP connection driven by event-loop callbacks: frames (wire.py) in,
each part landing straight where it belongs, and frames out, with no task per connection.

The socket stays ours (non-blocking): one reader callback is registered for the
connection's life, so waiting for bytes costs no future, no task switch and no poller
registration per wait. A subclass says what it expects next with `expect(views, then)`: the
bytes that follow fill `views` in order, then `then()` runs (and calls `expect` again).

How bytes are read:
- a frame's small leading parts (header, piece table, meta) through a scratch buffer, up
  to 16 KiB at a time, copied out: a small frame costs one receive, not one per part (and a
  large payload's head is copied twice for no more than 16 KiB);
- whole frames in those bytes may be `skim`med by the subclass without the steps (a
  sender's ACKs; a WRITE's header and piece table, whose payload then lands in place):
  after a wake-up every Python call is paid cold, so the common frames take few;
- payloads with `recvmsg_into` straight into the target pieces (up to IOV_MAX of them per
  call, no copy), with SO_RCVLOWAT raised while one waits so the loop wakes once per
  ~1 MiB queued rather than once per packet (that, not threads, is what brings a single
  connection to the plain-socket rate).

`send(parts)` writes at once what the kernel takes (one vectored `sendmsg` for a frame's few
parts, or per batch of many) and queues the rest, references to the caller's buffers and not
copies, until the socket is writable; `pause_writing`/`resume_writing` tell the subclass when
the queue fills and drains. `send_frame(head, payload)` sends a frame's head in a call of its
own before its payload, so the peer is woken while the payload is still being copied.

Invariants: bytes are consumed strictly in order, each once (what `skim` declines goes to
the steps untouched); after `pause()` no step runs until `resume()` (bytes already read are
kept and fed first); after `abort()` no callback is registered and the socket is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from transfer_engine import sock_io

_SCRATCH_BYTES = 16 << 10  # also the largest part that is read through the scratch buffer
_RCVLOWAT_BYTES = 1 << 20
_READS_PER_WAKE = 64  # then let the loop run others (the reader is called again: level-triggered)
_PAUSE_WRITING_BYTES = 4 << 20  # queued output above which the subclass stops submitting
_FEW_PARTS = 8  # sent in one call, all of them (a large batch goes a slice at a time)


class FrameStream:
    """A connection's reading steps and its output queue; subclasses (`tcp.Link`,
    `tcp_server._Inbound`) say what each frame's steps are."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        self._views: list[memoryview] = []
        self._index = 0  # the view being filled
        self._then: Callable[[], None] | None = None
        self._left = 0  # bytes still expected by the current views
        self._is_paused = False
        self._backlog = memoryview(b"")  # read before a pause, fed on resume
        self._lowat = 1
        self._out: list[memoryview | bytes] = []  # queued output, in order
        self._num_out_bytes = 0
        self._is_write_paused = False
        self._is_closing = False  # close once the output is sent
        self.is_closed = False

    # --- what subclasses call -------------------------------------------------------------

    def start(self) -> None:
        """Begin reading (after the subclass set its first `expect`)."""
        self._loop.add_reader(self._fd, self._on_readable)

    def expect(self, views: list[memoryview], then: Callable[[], None]) -> None:
        """The next bytes fill `views` in order; then `then()` runs (at once if there are
        none). Every step ends by calling `expect` again, `pause`, or `abort`."""
        if len(views) == 1:  # a header, a body: the common step
            self._views = [views[0]] if views[0].nbytes else []
            self._left = views[0].nbytes
        else:
            self._views = [view for view in views if view.nbytes]
            self._left = sum(view.nbytes for view in self._views)
        self._index = 0
        self._then = then
        if not self._views and not self._is_paused:
            self._finish()

    def pause(self) -> None:
        """Hold the frames that follow (while this one is finished off the loop)."""
        if not self._is_paused and not self.is_closed:
            self._is_paused = True
            self._loop.remove_reader(self._fd)

    def resume(self) -> None:
        if not self._is_paused or self.is_closed:
            return
        self._is_paused = False
        if not self._views and self._then is not None:
            self._finish()
        backlog, self._backlog = self._backlog, memoryview(b"")
        self._feed(backlog)
        if not self._is_paused and not self.is_closed:
            self._set_lowat()  # the mark may still be a finished payload's
            self._loop.add_reader(self._fd, self._on_readable)

    def send(self, parts: list[memoryview | bytes]) -> None:
        """Write `parts` in order after whatever is queued; never blocks."""
        if self.is_closed:
            return
        if not self._out:
            parts = self._send_now(parts)
            if not parts:
                return
            self._loop.add_writer(self._fd, self._on_writable)
        self._out.extend(parts)
        self._num_out_bytes += sum(len(part) for part in parts)
        if self._num_out_bytes > _PAUSE_WRITING_BYTES and not self._is_write_paused:
            self._is_write_paused = True
            self.pause_writing()

    def send_frame(self, head: list[memoryview | bytes],
                   payload: list[memoryview | bytes]) -> None:
        """Send a frame's head, then its payload (if any) in a call of its own: the peer
        wakes to the head while the payload is still being copied, not after it (waking an
        idle vCPU takes tens of microseconds; transfer_engine/README.md)."""
        self.send(head)
        if payload:
            self.send(payload)

    def close_after_send(self) -> None:
        """Stop reading; close once everything queued is sent (an ERROR frame, say)."""
        self.pause()
        self._is_closing = True
        if not self._out:
            self.abort()

    def abort(self, error: Exception | None = None) -> None:
        """Unregister, close the socket, drop queued output; then `connection_lost`."""
        if self.is_closed:
            return
        self.is_closed = True
        if not self._is_paused:
            self._loop.remove_reader(self._fd)
        if self._out:
            self._loop.remove_writer(self._fd)
            self._out.clear()
        self._views, self._then = [], None
        sock_io.abort(self._sock)
        self.connection_lost(error)

    # --- what subclasses may override -----------------------------------------------------

    def connection_lost(self, error: Exception | None) -> None:
        """The connection is closed (`error` None: by us, or the peer closed it cleanly)."""

    def pause_writing(self) -> None:
        """Output queued past the high-water mark."""

    def resume_writing(self) -> None:
        """The queued output was sent."""

    def skim(self, data: memoryview) -> memoryview:
        """Handle whole frames straight from received bytes, skipping the steps (a sender's
        plain ACKs, say); return the bytes the steps are still to read. Only frames that
        start at `data`'s first byte may be taken, and only when no step is half-read."""
        return data

    # --- reading --------------------------------------------------------------------------

    def _on_readable(self) -> None:
        self._read_available()
        if not self.is_closed:
            # Whatever ended the reads (no more bytes, a full batch of them, a pause), the
            # mark must not exceed what the current step still expects.
            self._set_lowat()

    def _read_available(self) -> None:
        for _ in range(_READS_PER_WAKE):
            if self._is_paused or self.is_closed or not self._views:
                return
            try:
                if self._index == len(self._views) - 1 and self._left <= _SCRATCH_BYTES:
                    wanted = _SCRATCH_BYTES
                    received = self._sock.recv_into(self._scratch)
                    if received:
                        self._feed(self.skim(self._scratch[:received]))
                else:
                    batch, wanted = sock_io.next_batch(self._views, self._index)
                    step = self._then
                    received = self._sock.recvmsg_into(batch)[0]
                    if received:
                        self._advance(batch, received)
                        if self._then is not step:
                            # A payload is in. The next frame rarely is yet: leave it to the
                            # poller (level-triggered) rather than pay a receive that fails.
                            return
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                self.abort(error)
                return
            if received == 0:
                self.abort(sock_io.ConnectionClosed("peer closed the connection"))
                return
            if received < wanted:  # the kernel had no more: skip the receive that says so
                return

    def _advance(self, batch: list[memoryview], num_bytes: int) -> None:
        """`num_bytes` landed straight in `batch` (the current views)."""
        self._left -= num_bytes
        self._index = sock_io.advance(self._views, self._index, batch, num_bytes)
        if self._index == len(self._views):
            self._finish()

    def _feed(self, data: memoryview) -> None:
        """Copy scratch bytes into the expected views, running each step as its views fill."""
        while data.nbytes:
            if self._is_paused or self.is_closed or not self._views:
                if not self.is_closed:
                    self._backlog = memoryview(bytes(self._backlog) + bytes(data))
                return
            view = self._views[self._index]
            count = min(view.nbytes, data.nbytes)
            view[:count] = data[:count]
            data = data[count:]
            self._left -= count
            if count < view.nbytes:
                self._views[self._index] = view[count:]
                return
            self._index += 1
            if self._index == len(self._views):
                self._finish()

    def _finish(self) -> None:
        then, self._then = self._then, None
        self._views, self._index = [], 0
        if then is not None:
            then()

    def _set_lowat(self) -> None:
        """Before waiting: for a payload, wake once ~1 MiB (or all it still needs) is queued;
        for anything else, at the first byte."""
        wanted = min(self._left, _RCVLOWAT_BYTES) if self._left > _SCRATCH_BYTES else 1
        if wanted != self._lowat:
            with contextlib.suppress(OSError):
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
                self._lowat = wanted

    # --- writing --------------------------------------------------------------------------

    def _send_now(self, parts: list[memoryview | bytes]) -> list[memoryview | bytes]:
        """Send what the kernel takes now; return what is left."""
        if len(parts) <= _FEW_PARTS:  # a frame: one call, and usually the kernel takes it all
            try:
                sent = self._sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as error:
                self.abort(error)
                return []
            index = sock_io.advance(parts, 0, parts, sent)
            if index == len(parts):
                return []
            parts = parts[index:]
        pending = [part for part in parts if len(part)]
        try:
            index = sock_io.send_available(self._sock, pending)
        except OSError as error:
            self.abort(error)
            return []
        return pending[index:]

    def _on_writable(self) -> None:
        left = self._send_now(self._out)
        if self.is_closed:
            return
        self._out = left
        self._num_out_bytes = sum(len(part) for part in left)
        if left:
            return
        self._loop.remove_writer(self._fd)
        if self._is_closing:
            self.abort()
            return
        if self._is_write_paused:
            self._is_write_paused = False
            self.resume_writing()
