"""The inbound side of the TCP transport: accept peers, check their secret, and serve their
frames (see wire.py) straight into and out of registered memory.

One task per connection handles its frames in order. A bad piece (unknown segment, out of
bounds) is refused with an ERROR frame after its payload is drained, and the connection lives
on; bytes that are not our protocol close the connection. Neither touches memory or stops
the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

import numpy as np
import structlog

from shared.messages import TransferEndpoint
from transfer_engine import compression, sock_io, wire
from transfer_engine.errors import (
    AuthenticationRefused,
    InvalidTransfer,
    ProtocolViolation,
    TransferFailed,
)
from transfer_engine.memory import LocalMemory
from transfer_engine.transport import Deliver

log = structlog.get_logger(__name__)

_DISCARD_CHUNK_BYTES = 1 << 20


class TcpServer:
    def __init__(self, secret: bytes, memory: LocalMemory, deliver: Deliver,
                 endpoint: Callable[[], TransferEndpoint], frame_timeout_s: float) -> None:
        self._secret = secret
        self._memory = memory
        self._deliver = deliver
        self._endpoint = endpoint
        self._frame_timeout_s = frame_timeout_s
        self._listener: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._socks: set[socket.socket] = set()
        # Set by the RDMA transport: make a queue pair for a connecting peer, return its info.
        self.accept_rdma: Callable[[str, wire.QpInfo], wire.QpInfo] | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen; return the bound port."""
        listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        listener.setblocking(False)
        self._listener = listener
        self._spawn(self._accept_loop(listener))
        return listener.getsockname()[1]

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in list(self._socks):
            sock_io.abort(sock)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(sock))

    async def _serve(self, sock: socket.socket) -> None:
        self._socks.add(sock)
        peer_id = "?"
        try:
            async with asyncio.timeout(self._frame_timeout_s):
                peer_id = await self._handshake(sock)
            while True:
                header = await _recv_header(sock)
                async with asyncio.timeout(self._frame_timeout_s):
                    await self._handle(sock, peer_id, header)
        except (sock_io.ConnectionClosed, ConnectionError):
            pass
        except AuthenticationRefused as error:
            log.warning("transfer.peer_refused", reason=error.message)
            await _send_error(sock, 0, wire.ErrorKind.AUTH, error.message)
        except ProtocolViolation as error:
            log.warning("transfer.protocol_violation", peer_id=peer_id, reason=error.message)
            await _send_error(sock, 0, wire.ErrorKind.PROTOCOL, error.message)
        except TimeoutError:
            log.warning("transfer.peer_stalled", peer_id=peer_id)
        except Exception:
            log.exception("transfer.serve_failed", peer_id=peer_id)
        finally:
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

    async def _handle(self, sock: socket.socket, peer_id: str, header: wire.Header) -> None:
        table_bytes = await sock_io.recv_bytes(sock, header.num_pieces * wire.PIECE.size)
        table = wire.unpack_pieces(table_bytes)
        meta_bytes = await sock_io.recv_bytes(sock, header.meta_len)
        if header.op == wire.Op.RDMA_CONNECT:
            await self._connect_rdma(sock, peer_id, header, meta_bytes)
            return
        meta = wire.decode(meta_bytes, wire.FrameMeta) if meta_bytes else wire.FrameMeta()
        match header.op:
            case wire.Op.WRITE:
                if not await self._land(sock, header, table, meta):
                    return
                self._memory.landed(table)
                self._deliver(peer_id, meta.notifications)
                await sock_io.send(sock, [wire.Header(wire.Op.ACK, header.request_id).pack()])
            case wire.Op.READ:
                await self._serve_read(sock, header, table)
            case wire.Op.NOTIFY:
                self._deliver(peer_id, meta.notifications)
                await sock_io.send(sock, [wire.Header(wire.Op.ACK, header.request_id).pack()])
            case _:
                raise ProtocolViolation(f"unexpected {header.op.name} from a peer")

    async def _connect_rdma(self, sock: socket.socket, peer_id: str, header: wire.Header,
                            meta_bytes: bytes) -> None:
        if self.accept_rdma is None:
            await _send_error(sock, header.request_id, wire.ErrorKind.INVALID,
                              "this engine has no RDMA device")
            return
        try:
            reply = wire.encode(self.accept_rdma(peer_id, wire.decode(meta_bytes, wire.QpInfo)))
        except TransferFailed as error:
            await _send_error(sock, header.request_id, wire.ErrorKind.INVALID, error.message)
            return
        await sock_io.send(sock, [wire.Header(wire.Op.ACK, header.request_id,
                                              meta_len=len(reply)).pack(), reply])

    async def _land(self, sock: socket.socket, header: wire.Header,
                    table: np.ndarray, meta: wire.FrameMeta) -> bool:
        """Receive a WRITE's payload into its pieces; False if it was refused (and drained)."""
        try:
            views = self._memory.views(table, for_write=True)
            sizes = [_wire_size(view.nbytes, meta.compression) for view in views]
            if sum(sizes) != header.payload_len:
                raise InvalidTransfer(f"payload of {header.payload_len} bytes does not match "
                                      f"its pieces ({sum(sizes)} bytes)")
        except InvalidTransfer as error:
            await _discard(sock, header.payload_len)
            await _send_error(sock, header.request_id, wire.ErrorKind.INVALID, error.message)
            return False
        if meta.compression is None:
            await sock_io.recv_into(sock, views)
            return True
        payload = memoryview(bytearray(header.payload_len))
        await sock_io.recv_into(sock, [payload])
        await asyncio.to_thread(_decompress_all, payload, sizes, views, meta.compression)
        return True

    async def _serve_read(self, sock: socket.socket, header: wire.Header,
                          table: np.ndarray) -> None:
        try:
            views = self._memory.views(table, for_write=False)
        except InvalidTransfer as error:
            await _send_error(sock, header.request_id, wire.ErrorKind.INVALID, error.message)
            return
        self._memory.before_read(table)
        total = sum(view.nbytes for view in views)
        await sock_io.send(sock, [wire.Header(wire.Op.DATA, header.request_id,
                                              payload_len=total).pack(), *views])


def _wire_size(num_bytes: int, compress: wire.Compression | None) -> int:
    return num_bytes if compress is None else compression.compressed_size(num_bytes, compress)


def _decompress_all(payload: memoryview, sizes: list[int], views: list[memoryview],
                    compress: wire.Compression) -> None:
    offset = 0
    for size, view in zip(sizes, views, strict=True):
        compression.decompress_into(payload[offset:offset + size], compress, view)
        offset += size


async def _recv_header(sock: socket.socket) -> wire.Header:
    return wire.unpack_header(await sock_io.recv_bytes(sock, wire.HEADER.size))



async def _discard(sock: socket.socket, num_bytes: int) -> None:
    scratch = memoryview(bytearray(min(num_bytes, _DISCARD_CHUNK_BYTES)))
    while num_bytes:
        chunk = scratch[:min(num_bytes, scratch.nbytes)]
        await sock_io.recv_into(sock, [chunk])
        num_bytes -= chunk.nbytes


async def _send_error(sock: socket.socket, request_id: int, kind: wire.ErrorKind,
                      message: str) -> None:
    body = wire.encode(wire.ErrorBody(kind=kind, message=message))
    with contextlib.suppress(OSError):  # the peer may be gone; then there is no one to tell
        await sock_io.send(sock, [wire.Header(wire.Op.ERROR, request_id,
                                              meta_len=len(body)).pack(), body])
