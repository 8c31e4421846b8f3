"""The inbound side of the TCP transport: accept peers, check their secret, and serve their
frames (see wire.py) straight into and out of registered memory.

The handshake runs as a coroutine on the socket; the authenticated connection is then an
`_Inbound` stream (frame_stream.py) that the event loop calls as bytes arrive, so a frame
costs no task switch and no per-wait registration with the poller. Frames of one
connection are served in order. A bad piece (unknown segment, out of bounds) is refused
with an ERROR frame after its payload is drained, and the connection lives on; bytes that
are not our protocol close the connection. Neither touches memory or stops the engine. A
peer that stalls mid-frame (or stops reading our answers) for `frame_timeout_s` is cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

import structlog

from shared.messages import TransferEndpoint
from transfer_engine import compression, sock_io, wire
from transfer_engine.errors import (
    AuthenticationRefused,
    InvalidTransfer,
    ProtocolViolation,
    TransferFailed,
)
from transfer_engine.frame_stream import FrameStream
from transfer_engine.memory import LocalMemory
from transfer_engine.transport import Deliver

log = structlog.get_logger(__name__)

_DISCARD_CHUNK_BYTES = 1 << 20


class TcpServer:
    def __init__(self, secret: bytes, memory: LocalMemory, deliver: Deliver,
                 endpoint: Callable[[], TransferEndpoint], frame_timeout_s: float) -> None:
        self._secret = secret
        self.memory = memory
        self.deliver = deliver
        self._endpoint = endpoint
        self.frame_timeout_s = frame_timeout_s
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._socks: set[socket.socket] = set()  # connections still in their handshake
        self._inbound: set[_Inbound] = set()
        # Set by the RDMA transport: make a queue pair for a connecting peer, return its info.
        self.accept_rdma: Callable[[str, wire.QpInfo], wire.QpInfo] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; return the bound port."""
        listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self.spawn(self._accept_loop(listener))
        return listener.getsockname()[1]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in list(self._socks):
            sock_io.abort(sock)
        for inbound in list(self._inbound):
            inbound.abort()
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def opened(self, inbound: _Inbound) -> None:
        self._inbound.add(inbound)

    def closed(self, inbound: _Inbound) -> None:
        self._inbound.discard(inbound)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.spawn(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        """Authenticate the peer, then hand the connection to an `_Inbound` protocol."""
        self._socks.add(sock)
        try:
            async with asyncio.timeout(self.frame_timeout_s):
                peer_id = await self._handshake(sock)
            self._socks.discard(sock)
            _Inbound(self, peer_id, sock).start()
            return
        except (sock_io.ConnectionClosed, ConnectionError):
            pass
        except AuthenticationRefused as error:
            log.warning("transfer.peer_refused", reason=error.message)
            await _send_error(sock, 0, wire.ErrorKind.AUTH, error.message)
        except ProtocolViolation as error:
            log.warning("transfer.protocol_violation", peer_id="?", reason=error.message)
            await _send_error(sock, 0, wire.ErrorKind.PROTOCOL, error.message)
        except TimeoutError:
            log.warning("transfer.peer_stalled", peer_id="?")
        except Exception:
            log.exception("transfer.serve_failed", peer_id="?")
        self._socks.discard(sock)
        sock_io.abort(sock)

    async def _handshake(self, sock: socket.socket) -> str:
        challenge = os.urandom(wire.CHALLENGE_BYTES)
        await sock_io.send(sock, [challenge])
        header = await _recv_header(sock)
        if header.op != wire.Op.HELLO:
            raise ProtocolViolation(f"expected HELLO, got {header.op.name}")
        hello = wire.decode(await sock_io.recv_bytes(sock, header.meta_len), wire.Hello)
        if not wire.is_signed(self._secret, challenge, hello.engine_id, hello.mac):
            raise AuthenticationRefused(f"peer {hello.engine_id!r} failed authentication")
        endpoint = self._endpoint()
        welcome = wire.encode(wire.Welcome(
            endpoint=endpoint,
            mac=wire.sign(self._secret, hello.challenge, endpoint.engine_id)))
        await sock_io.send(sock, [wire.Header(wire.Op.WELCOME, meta_len=len(welcome)).pack(),
                                  welcome])
        return hello.engine_id


class _Inbound(FrameStream):
    """One authenticated peer's connection: header, then piece table and meta, then payload;
    each step says what it expects next."""

    def __init__(self, server: TcpServer, peer_id: str, sock: socket.socket) -> None:
        super().__init__(sock)
        self._server = server
        self._memory = server.memory
        self._peer_id = peer_id
        self._header_bytes = memoryview(bytearray(wire.HEADER.size))
        self._on_header_step = self._on_header  # one bound method: `skim` knows the step by it
        self._body = memoryview(b"")
        self._header = wire.Header(wire.Op.ACK)
        self._frame_since: float | None = None  # when the frame being received began
        self._held_since: float | None = None  # when the peer stopped reading our answers
        self._watchdog: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._server.opened(self)
        self._watch()
        self._next_frame()
        super().start()

    def connection_lost(self, error: Exception | None) -> None:
        self._server.closed(self)
        if self._watchdog is not None:
            self._watchdog.cancel()

    def pause_writing(self) -> None:
        self.pause()  # no more frames until the peer reads our answers
        self._held_since = self._loop.time()

    def resume_writing(self) -> None:
        self._held_since = None
        self.resume()

    def _watch(self) -> None:
        """Every quarter of `frame_timeout_s`: cut off a peer stalled for longer than it."""
        since = min((t for t in (self._frame_since, self._held_since) if t is not None),
                    default=None)
        if since is not None and self._loop.time() - since > self._server.frame_timeout_s:
            log.warning("transfer.peer_stalled", peer_id=self._peer_id)
            self.abort()
            return
        self._watchdog = self._loop.call_later(max(self._server.frame_timeout_s / 4, 0.01),
                                               self._watch)

    def skim(self, data: memoryview) -> memoryview:
        """A WRITE whose header and piece table arrived whole (most do, in the same receive
        as the head of their payload) is parsed straight from the received bytes."""
        if (self._then is not self._on_header_step or self._left != _HEADER_BYTES
                or len(data) < _HEADER_BYTES or data[_OP_BYTE] != _WRITE):
            return data
        if len(data) >= _WRITE_ONE_BYTES:
            (magic, version, _, _, request_id, num_pieces, meta_len, payload_len, segment_id,
             offset, length) = wire.WRITE_ONE.unpack_from(data)
            if (num_pieces == 1 and not meta_len and payload_len == length
                    and magic == wire.MAGIC and version == wire.VERSION):
                return self._skim_one_piece(data, request_id, segment_id, offset, length)
        try:
            header = wire.unpack_header(data[:_HEADER_BYTES])
        except ProtocolViolation:
            return data  # the steps refuse it
        end = _HEADER_BYTES + header.num_pieces * wire.PIECE.size
        if header.meta_len or len(data) < end:
            return data
        self._frame_since = self._loop.time()
        # A copy: the received bytes are a scratch buffer the next receive overwrites.
        self._on_write(header, memoryview(bytes(data[_HEADER_BYTES:end])), _NO_META)
        return data[end:]

    def _skim_one_piece(self, data: memoryview, request_id: int, segment_id: int,
                        offset: int, length: int) -> memoryview:
        """A WRITE of one piece (a layer, say): its payload lands in place with the fewest
        calls (each is paid cold after a wake-up)."""
        try:
            view = self._memory.view(segment_id, offset, length, for_write=True)
        except InvalidTransfer:
            return data  # the steps refuse it, after draining its payload
        self._frame_since = self._loop.time()
        table = memoryview(bytes(data[_HEADER_BYTES:_WRITE_ONE_BYTES]))
        self.expect([view], lambda: self._landed(request_id, table, _NO_META))
        return data[_WRITE_ONE_BYTES:]

    def _next_frame(self) -> None:
        self._frame_since = None
        self.expect([self._header_bytes], self._on_header_step)

    def _on_header(self) -> None:
        try:
            header = wire.unpack_header(self._header_bytes)
        except ProtocolViolation as error:
            self._refuse(error)
            return
        self._frame_since = self._loop.time()
        self._header = header
        self._body = memoryview(bytearray(header.num_pieces * wire.PIECE.size
                                          + header.meta_len))
        self.expect([self._body], self._on_body)

    def _on_body(self) -> None:
        header = self._header
        table_bytes = header.num_pieces * wire.PIECE.size
        table = self._body[:table_bytes]
        meta_bytes = self._body[table_bytes:]
        try:
            match header.op:
                case wire.Op.WRITE:
                    self._on_write(header, table, _frame_meta(meta_bytes))
                case wire.Op.READ | wire.Op.STAGE:
                    self._on_read(header, table)
                case wire.Op.NOTIFY:
                    self._on_notify(header, table, _frame_meta(meta_bytes))
                case wire.Op.RDMA_CONNECT:
                    self._connect_rdma(header, bytes(meta_bytes))
                case _:
                    raise ProtocolViolation(f"unexpected {header.op.name} from a peer")
        except ProtocolViolation as error:
            self._refuse(error)

    def _on_write(self, header: wire.Header, table: memoryview, meta: wire.FrameMeta) -> None:
        try:
            views = self._memory.views(table, for_write=True)
            sizes = [view.nbytes for view in views] if meta.compression is None else [
                compression.compressed_size(view.nbytes, meta.compression) for view in views]
            if sum(sizes) != header.payload_len:
                raise InvalidTransfer(f"payload of {header.payload_len} bytes does not match "
                                      f"its pieces ({sum(sizes)} bytes)")
        except InvalidTransfer as error:
            self._discard(header.payload_len, header.request_id, error.message)
            return
        if meta.compression is None:
            self.expect(views, lambda: self._landed(header.request_id, table, meta))
            return
        payload = memoryview(bytearray(header.payload_len))
        kind = meta.compression

        def decompress() -> None:  # then to a device, if staged
            _decompress_all(payload, sizes, views, kind)
            self._memory.landed(table)

        self.expect([payload], lambda: self._off_loop(
            decompress, lambda: self._acknowledge(header.request_id, meta)))

    def _landed(self, request_id: int, table: memoryview, meta: wire.FrameMeta) -> None:
        """The frame's bytes are in its pieces: staged ones go to their device, off the loop
        (a copy per piece, then a wait for the device); then notify and acknowledge."""
        if self._memory.has_staged:
            self._off_loop(lambda: self._memory.landed(table),
                           lambda: self._acknowledge(request_id, meta))
            return
        self._acknowledge(request_id, meta)

    def _acknowledge(self, request_id: int, meta: wire.FrameMeta) -> None:
        if meta.notifications:
            self._server.deliver(self._peer_id, meta.notifications)
        self.send([wire.ack(request_id)])
        self._next_frame()

    def _off_loop(self, work: Callable[[], None], then: Callable[[], None]) -> None:
        """Run `work` in a thread, the frames after this one waiting; then `then()` on the
        loop. A failure closes the connection: the peer's transfer fails, never hangs."""
        self.pause()

        async def run() -> None:
            try:
                await asyncio.to_thread(work)
            except Exception:
                log.exception("transfer.serve_failed", peer_id=self._peer_id)
                self.abort()
                return
            then()
            self.resume()

        self._server.spawn(run())

    def _on_notify(self, header: wire.Header, table: memoryview, meta: wire.FrameMeta) -> None:
        """After a one-sided write (shm): the pieces it wrote into staged segments go to their
        devices, then its notifications are delivered, as for a WRITE that landed here."""
        try:
            self._memory.views(table, for_write=True)  # ours, in bounds: else refused
        except InvalidTransfer as error:
            self._answer(*_error_frame(header.request_id, wire.ErrorKind.INVALID, error.message))
            return
        self._landed(header.request_id, table, meta)

    def _on_read(self, header: wire.Header, table: memoryview) -> None:
        """READ: the pieces' bytes, in a DATA answer. STAGE (before a one-sided read over
        shm): only the staged pieces moved from device to mirror, then ACK."""
        try:
            views = self._memory.views(table, for_write=False)
        except InvalidTransfer as error:
            self._answer(*_error_frame(header.request_id, wire.ErrorKind.INVALID, error.message))
            return
        if self._memory.has_staged:  # staged pieces come from their device first
            self._off_loop(lambda: self._memory.before_read(table),
                           lambda: self._answer_read(header, views))
            return
        self._answer_read(header, views)

    def _answer_read(self, header: wire.Header, views: list[memoryview]) -> None:
        if header.op == wire.Op.STAGE:
            self._answer(wire.Header(wire.Op.ACK, header.request_id))
            return
        total = sum(view.nbytes for view in views)
        self.send_frame([wire.Header(wire.Op.DATA, header.request_id, payload_len=total).pack()],
                        views)
        self._next_frame()

    def _connect_rdma(self, header: wire.Header, meta: bytes) -> None:
        if self._server.accept_rdma is None:
            self._answer(*_error_frame(header.request_id, wire.ErrorKind.INVALID,
                                       "this engine has no RDMA device"))
            return
        try:
            reply = wire.encode(self._server.accept_rdma(self._peer_id,
                                                         wire.decode(meta, wire.QpInfo)))
        except TransferFailed as error:
            self._answer(*_error_frame(header.request_id, wire.ErrorKind.INVALID, error.message))
            return
        self._answer(wire.Header(wire.Op.ACK, header.request_id, meta_len=len(reply)), reply)

    def _discard(self, num_bytes: int, request_id: int, message: str,
                 scratch: memoryview | None = None) -> None:
        """Drain a refused payload a chunk at a time (one scratch buffer), then refuse it
        with an ERROR frame."""
        if num_bytes == 0:
            self._answer(*_error_frame(request_id, wire.ErrorKind.INVALID, message))
            return
        scratch = scratch or memoryview(bytearray(min(num_bytes, _DISCARD_CHUNK_BYTES)))
        chunk = scratch[:min(num_bytes, scratch.nbytes)]
        self.expect([chunk], lambda: self._discard(num_bytes - chunk.nbytes, request_id,
                                                   message, scratch))

    def _answer(self, header: wire.Header, *parts: bytes | memoryview) -> None:
        """Send a frame back, then read the next one."""
        self.send([header.pack(), *parts])
        self._next_frame()

    def _refuse(self, error: ProtocolViolation) -> None:
        """Bytes that are not our protocol: say so and close (after the ERROR is sent)."""
        log.warning("transfer.protocol_violation", peer_id=self._peer_id, reason=error.message)
        header, body = _error_frame(0, wire.ErrorKind.PROTOCOL, error.message)
        self.send([header.pack(), body])
        self.close_after_send()


_NO_META = wire.FrameMeta()
_HEADER_BYTES = wire.HEADER.size
_WRITE_ONE_BYTES = wire.WRITE_ONE.size
_OP_BYTE = 5  # a header's op, after the magic and the version
_WRITE = int(wire.Op.WRITE)


def _frame_meta(meta_bytes: memoryview) -> wire.FrameMeta:
    return wire.decode(meta_bytes, wire.FrameMeta) if meta_bytes.nbytes else _NO_META


def _error_frame(request_id: int, kind: wire.ErrorKind,
                 message: str) -> tuple[wire.Header, bytes]:
    body = wire.encode(wire.ErrorBody(kind=kind, message=message))
    return wire.Header(wire.Op.ERROR, request_id, meta_len=len(body)), body


def _decompress_all(payload: memoryview, sizes: list[int], views: list[memoryview],
                    compress: wire.Compression) -> None:
    offset = 0
    for size, view in zip(sizes, views, strict=True):
        compression.decompress_into(payload[offset:offset + size], compress, view)
        offset += size


async def _recv_header(sock: socket.socket) -> wire.Header:
    return wire.unpack_header(await sock_io.recv_bytes(sock, wire.HEADER.size))


async def _send_error(sock: socket.socket, request_id: int, kind: wire.ErrorKind,
                      message: str) -> None:
    with contextlib.suppress(OSError):  # the peer may be gone; then there is no one to tell
        header, body = _error_frame(request_id, kind, message)
        await sock_io.send(sock, [header.pack(), body])
