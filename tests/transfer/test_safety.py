"""A bad peer cannot corrupt memory, crash the engine, or hang a caller: bad secrets, frames
that break the protocol, pieces outside segments, and what `close()` leaves behind."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from tests.transfer.conftest import SECRET, SEGMENT_BYTES, Pair, start_pair
from transfer_engine import sock_io, wire
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import AuthenticationRefused, TransferFailed
from transfer_engine.registry import LocalEndpointRegistry


@pytest.fixture
async def tcp_pair() -> Pair:
    running = await start_pair("tcp")
    yield running
    await running.source.close()
    await running.target.close()


class RawPeer:
    """A hand-driven TCP peer, to send what a well-behaved engine never would."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def connect(cls, engine: TransferEngine, secret: bytes = SECRET) -> RawPeer:
        sock = socket.create_connection(("127.0.0.1", engine.endpoint().tcp_port))
        sock.setblocking(False)
        peer = cls(sock)
        challenge = await peer.recv(wire.CHALLENGE_BYTES)
        hello = wire.encode(wire.Hello("raw", os.urandom(32), wire.sign(secret, challenge, "raw")))
        await peer.send(wire.Header(wire.Op.HELLO, meta_len=len(hello)).pack(), hello)
        return peer

    async def send(self, *parts: bytes) -> None:
        await sock_io.send(self.sock, list(parts))

    async def recv(self, num_bytes: int) -> bytes:
        return await asyncio.wait_for(sock_io.recv_bytes(self.sock, num_bytes), 5)

    async def frame(self) -> tuple[wire.Header, bytes]:
        header = wire.unpack_header(await self.recv(wire.HEADER.size))
        return header, await self.recv(header.meta_len)

    async def write(self, segment_id: int, offset: int, length: int, payload: bytes,
                    request_id: int = 1) -> tuple[wire.Header, bytes]:
        table = wire.PIECE.pack(segment_id, offset, length)
        header = wire.Header(wire.Op.WRITE, request_id, 1, payload_len=len(payload))
        await self.send(header.pack(), table, payload)
        return await self.frame()

    async def is_closed_by_peer(self) -> bool:
        try:
            await self.recv(1)
        except sock_io.ConnectionClosed:
            return True
        return False


def kv_id(engine: TransferEngine) -> int:
    return next(s.segment_id for s in engine.endpoint().segments if s.name == "kv")


async def welcomed(engine: TransferEngine) -> RawPeer:
    peer = await RawPeer.connect(engine)
    header, _ = await peer.frame()
    assert header.op == wire.Op.WELCOME
    return peer


async def assert_still_serves(pair: Pair) -> None:
    pair.source_kv[:8] = b"alive!!!"
    await pair.source.write(pair.target.config.engine_id, [("kv", 0, "kv", 0, 8)])
    assert pair.target_kv[:8] == b"alive!!!"


async def test_a_wrong_secret_is_refused_and_nothing_lands(tcp_pair: Pair) -> None:
    registry = LocalEndpointRegistry()
    await registry.put(tcp_pair.target.endpoint())
    intruder = TransferEngine(TransferConfig(engine_id="intruder", secret=b"guess",
                                             transports=("tcp",)), registry)
    await intruder.start()
    try:
        await intruder.register("kv", bytearray(b"x" * 64))
        with pytest.raises(AuthenticationRefused, match="failed authentication"):
            await intruder.write(tcp_pair.target.config.engine_id, [("kv", 0, "kv", 0, 64)])
    finally:
        await intruder.close()
    assert tcp_pair.target_kv == bytes(SEGMENT_BYTES)
    await assert_still_serves(tcp_pair)


async def test_a_server_without_the_secret_is_not_trusted() -> None:
    """Mutual authentication: an impostor listening where a peer should be gets no bytes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()

    async def impostor() -> None:
        sock, _ = await loop.sock_accept(listener)
        sock.setblocking(False)
        with sock:
            await sock_io.send(sock, [os.urandom(wire.CHALLENGE_BYTES)])
            header = wire.unpack_header(await sock_io.recv_bytes(sock, wire.HEADER.size))
            await sock_io.recv_bytes(sock, header.meta_len)
            fake = TransferConfig(engine_id="impostor", secret=b"x")
            from shared.messages import TransferEndpoint
            welcome = wire.encode(wire.Welcome(
                TransferEndpoint(engine_id=fake.engine_id, host_id="h", tcp_host="127.0.0.1",
                                 tcp_port=1), mac=b"\0" * 32))
            await sock_io.send(sock, [wire.Header(wire.Op.WELCOME,
                                                  meta_len=len(welcome)).pack(), welcome])

    serving = asyncio.ensure_future(impostor())
    engine = TransferEngine(TransferConfig(engine_id="victim", secret=SECRET,
                                           transports=("tcp",)))
    await engine.start()
    try:
        with pytest.raises(AuthenticationRefused, match="does not hold the shared secret"):
            await engine.connect("127.0.0.1", listener.getsockname()[1])
    finally:
        await engine.close()
        await serving
        listener.close()


async def test_a_write_outside_the_segment_is_refused_and_the_connection_lives(
        tcp_pair: Pair) -> None:
    peer = await welcomed(tcp_pair.target)
    header, body = await peer.write(kv_id(tcp_pair.target), SEGMENT_BYTES - 4, 8, b"A" * 8)
    assert header.op == wire.Op.ERROR
    error = wire.decode(body, wire.ErrorBody)
    assert error.kind == wire.ErrorKind.INVALID
    assert "outside segment 'kv'" in error.message
    assert tcp_pair.target_kv == bytes(SEGMENT_BYTES)
    header, _ = await peer.write(kv_id(tcp_pair.target), 0, 4, b"good", request_id=2)
    assert (header.op, header.request_id) == (wire.Op.ACK, 2)
    assert tcp_pair.target_kv[:4] == b"good"


async def test_an_unknown_segment_id_is_refused(tcp_pair: Pair) -> None:
    peer = await welcomed(tcp_pair.target)
    header, body = await peer.write(9999, 0, 4, b"evil")
    assert header.op == wire.Op.ERROR
    assert "no segment with id 9999" in wire.decode(body, wire.ErrorBody).message
    assert tcp_pair.target_kv == bytes(SEGMENT_BYTES)


@pytest.mark.parametrize(("offset", "length"), [
    (0, 1 << 62),
    (1 << 62, 1 << 62),  # offset + length overflows a signed 64-bit sum
    ((1 << 64) - 8, 16),  # an offset that is negative as int64
    (8, (1 << 64) - 4),
])
async def test_an_oversized_length_or_offset_is_refused(
        tcp_pair: Pair, offset: int, length: int) -> None:
    peer = await welcomed(tcp_pair.target)
    header, body = await peer.write(kv_id(tcp_pair.target), offset, length, b"")
    assert header.op == wire.Op.ERROR
    assert wire.decode(body, wire.ErrorBody).kind == wire.ErrorKind.INVALID
    await assert_still_serves(tcp_pair)


async def test_a_payload_that_does_not_match_its_pieces_is_refused(tcp_pair: Pair) -> None:
    peer = await welcomed(tcp_pair.target)
    header, body = await peer.write(kv_id(tcp_pair.target), 0, 100, b"short")
    assert header.op == wire.Op.ERROR
    assert "does not match its pieces" in wire.decode(body, wire.ErrorBody).message
    assert tcp_pair.target_kv == bytes(SEGMENT_BYTES)


async def test_writes_split_anywhere_or_sent_together_land_alike(tcp_pair: Pair) -> None:
    """The server parses a WRITE straight from the bytes received when its header and table
    came whole (`_Inbound.skim`), else step by step: a frame sent a byte at a time, and two
    frames sent in one piece (the second parsed after the first's payload), land alike."""
    peer = await welcomed(tcp_pair.target)
    segment = kv_id(tcp_pair.target)

    def frame(request_id: int, offset: int, payload: bytes) -> bytes:
        return wire.write_one_head(request_id, segment, offset, len(payload)) + payload

    trickled = frame(1, 0, b"one byte at a time")
    for byte in trickled:
        await peer.send(bytes([byte]))
        await asyncio.sleep(0)
    header, _ = await peer.frame()
    assert (header.op, header.request_id) == (wire.Op.ACK, 1)
    await peer.send(frame(2, 100, b"first of two") + frame(3, 200, b"second of two"))
    answers = [await peer.frame() for _ in range(2)]
    assert [(h.op, h.request_id) for h, _ in answers] == [(wire.Op.ACK, 2), (wire.Op.ACK, 3)]
    assert bytes(tcp_pair.target_kv[:18]) == b"one byte at a time"
    assert bytes(tcp_pair.target_kv[100:112]) == b"first of two"
    assert bytes(tcp_pair.target_kv[200:213]) == b"second of two"


@pytest.mark.parametrize("garbage", [
    b"XXXX" + bytes(wire.HEADER.size - 4),  # bad magic
    wire.HEADER.pack(wire.MAGIC, 99, wire.Op.WRITE, 0, 1, 0, 0, 0),  # unknown version
    wire.HEADER.pack(wire.MAGIC, wire.VERSION, 200, 0, 1, 0, 0, 0),  # unknown op
    wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.WRITE, 0, 1, 1 << 30, 0, 0),  # too many
    wire.HEADER.pack(wire.MAGIC, wire.VERSION, wire.Op.ACK, 0, 1, 0, 0, 0),  # not for a server
])
async def test_a_malformed_frame_closes_only_that_connection(
        tcp_pair: Pair, garbage: bytes) -> None:
    peer = await welcomed(tcp_pair.target)
    await peer.send(garbage)
    header, body = await peer.frame()
    assert header.op == wire.Op.ERROR
    assert wire.decode(body, wire.ErrorBody).kind == wire.ErrorKind.PROTOCOL
    assert await peer.is_closed_by_peer()
    await assert_still_serves(tcp_pair)


async def test_a_peer_that_stalls_mid_frame_is_cut_off() -> None:
    pair = await start_pair("tcp", frame_timeout_s=0.3)
    try:
        peer = await welcomed(pair.target)
        table = wire.PIECE.pack(kv_id(pair.target), 0, 4096)
        await peer.send(wire.Header(wire.Op.WRITE, 1, 1, payload_len=4096).pack(), table,
                        b"half" * 512)  # half the payload, then silence
        assert await peer.is_closed_by_peer()
        await assert_still_serves(pair)
    finally:
        await pair.source.close()
        await pair.target.close()


async def test_an_idle_connection_is_not_cut_off() -> None:
    pair = await start_pair("tcp", frame_timeout_s=0.2)
    try:
        peer = await welcomed(pair.target)
        await asyncio.sleep(0.6)  # idle between frames: no frame is stalled
        header, _ = await peer.write(kv_id(pair.target), 0, 4, b"late")
        assert header.op == wire.Op.ACK
        assert pair.target_kv[:4] == b"late"
    finally:
        await pair.source.close()
        await pair.target.close()


async def test_garbage_instead_of_a_handshake_is_refused(tcp_pair: Pair) -> None:
    sock = socket.create_connection(("127.0.0.1", tcp_pair.target.endpoint().tcp_port))
    sock.setblocking(False)
    peer = RawPeer(sock)
    await peer.recv(wire.CHALLENGE_BYTES)
    await peer.send(wire.Header(wire.Op.WRITE).pack())
    header, _ = await peer.frame()
    assert header.op == wire.Op.ERROR
    assert await peer.is_closed_by_peer()
    await assert_still_serves(tcp_pair)


async def test_a_dead_peer_fails_fast(tcp_pair: Pair) -> None:
    target_id = tcp_pair.target.config.engine_id
    await tcp_pair.source.write(target_id, [("kv", 0, "kv", 0, 8)])  # descriptor cached
    await tcp_pair.target.close()
    with pytest.raises(TransferFailed, match=r"lost|cannot connect"):
        await tcp_pair.source.write(target_id, [("kv", 0, "kv", 0, 8)])


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def our_shm_names() -> set[str]:
    return {path.name for path in Path("/dev/shm").glob(f"halfmoon-te-{os.getpid()}-*")}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
async def test_close_releases_every_socket_mapping_and_name(transport: str) -> None:
    fds_before, names_before = open_fds(), our_shm_names()
    pair = await start_pair(transport)
    pair.source_kv[:] = os.urandom(SEGMENT_BYTES)
    await pair.source.write(pair.target.config.engine_id, [("kv", 0, "kv", 0, SEGMENT_BYTES)])
    await pair.target.read(pair.source.config.engine_id, [("kv", 0, "kv", 0, 4096)])
    assert our_shm_names() - names_before
    del pair.source_kv, pair.target_kv
    await pair.source.close()
    await pair.target.close()
    await pair.source.close()  # idempotent
    await asyncio.sleep(0.05)
    assert our_shm_names() == names_before
    assert open_fds() <= fds_before
