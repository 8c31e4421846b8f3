"""The TCP wire protocol between two transfer engines (version 1).

Every frame starts with a fixed 32-byte header; what follows depends on the op:

    header  = magic "HMTE" | version u8 | op u8 | flags u16 | request_id u64
              | num_pieces u32 | meta_len u32 | payload_len u64          (network order)
    WRITE   = header | pieces | meta | payload    land payload in my segments, then ACK
    READ    = header | pieces                     answer DATA with those bytes
    DATA    = header | payload                    bytes of a READ, in piece order
    NOTIFY  = header | pieces | meta              the pieces (often none) were written one-sidedly
                                                  (shm): staged ones go to their device; then
                                                  deliver meta after that data, and ACK
    STAGE   = header | pieces                     copy these staged pieces from device to host
                                                  mirror (a one-sided read follows), then ACK
    ACK     = header [| meta]                     meta = QpInfo, answering RDMA_CONNECT
    ERROR   = header | meta                       meta = ErrorBody
    RDMA_CONNECT = header | meta                  meta = QpInfo of the connector's queue pair
    piece   = segment_id u32 | offset u64 | length u64

`meta` of WRITE and NOTIFY is `FrameMeta` (msgpack): the notifications of the writes merged
into the frame and, for a compressed payload, how to decompress it.

Handshake: the acceptor sends a 32-byte challenge; the connector answers `Hello` (its id, its
own challenge, HMAC-SHA256(secret, acceptor challenge + its id)); the acceptor answers
`Welcome` (its descriptor and HMAC(secret, connector challenge + its id)) or an ERROR frame
and closes. Both sides therefore prove they hold the shared secret.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from typing import TYPE_CHECKING, TypeVar

import msgspec
import numpy as np

from shared.messages import TransferEndpoint
from transfer_engine.errors import ProtocolViolation

if TYPE_CHECKING:
    from transfer_engine.batch import Run

MAGIC = b"HMTE"
VERSION = 1
HEADER = struct.Struct("!4sBBHQIIQ")
PIECE = struct.Struct("!IQQ")
CHALLENGE_BYTES = 32
MAX_META_BYTES = 1 << 20
MAX_PIECES = 1 << 20

T = TypeVar("T")


class Op(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    WRITE = 3
    READ = 4
    DATA = 5
    NOTIFY = 6
    ACK = 7
    ERROR = 8
    RDMA_CONNECT = 9
    STAGE = 10


class ErrorKind(enum.StrEnum):
    INVALID = "invalid"  # bad segment or bounds: the request is refused, the connection lives
    PROTOCOL = "protocol"  # bytes that are not our protocol: the connection closes
    AUTH = "auth"
    INTERNAL = "internal"


class Header(msgspec.Struct, frozen=True):
    op: Op
    request_id: int = 0
    num_pieces: int = 0
    meta_len: int = 0
    payload_len: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.op, self.flags, self.request_id,
                           self.num_pieces, self.meta_len, self.payload_len)


_OPS = {op.value: op for op in Op}  # a dict lookup: Op(value) costs a microsecond per frame


def unpack_header(data: bytes | memoryview) -> Header:
    fields = HEADER.unpack(data)
    magic, version, op, flags, request_id, num_pieces, meta_len, payload_len = fields
    if magic != MAGIC:
        raise ProtocolViolation(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolViolation(f"unsupported protocol version {version}")
    op = _OPS.get(op)
    if op is None:
        raise ProtocolViolation(f"unknown op {fields[2]}")
    if meta_len > MAX_META_BYTES or num_pieces > MAX_PIECES:
        raise ProtocolViolation(f"frame too large: {num_pieces} pieces, {meta_len} meta bytes")
    return Header(op, request_id, num_pieces, meta_len, payload_len, flags)


# The piece table as a numpy record array: the same bytes as PIECE, packed or parsed at once.
PIECE_DTYPE = np.dtype([("segment_id", ">u4"), ("offset", ">u8"), ("length", ">u8")])


def pack_pieces(segment_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> bytes:
    table = np.empty(len(lengths), dtype=PIECE_DTYPE)
    table["segment_id"], table["offset"], table["length"] = segment_ids, offsets, lengths
    return table.tobytes()


def unpack_pieces(table: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(table, dtype=PIECE_DTYPE)


# A WRITE of one piece, its header and piece table packed at once (the layer-sized common case).
WRITE_ONE = struct.Struct(HEADER.format + PIECE.format[1:])


def write_one_head(request_id: int, segment_id: int, offset: int, length: int) -> bytes:
    """The header and table of a WRITE frame of one piece and no meta (the bytes of
    `Header(Op.WRITE, request_id, 1, 0, length).pack() + PIECE.pack(segment_id, offset,
    length)`)."""
    return WRITE_ONE.pack(MAGIC, VERSION, Op.WRITE, 0, request_id, 1, 0, length, segment_id,
                          offset, length)


def ack(request_id: int) -> bytes:
    """A plain ACK frame (`Header(Op.ACK, request_id).pack()`)."""
    return HEADER.pack(MAGIC, VERSION, Op.ACK, 0, request_id, 0, 0, 0)


def table_of(runs: list[Run]) -> bytes:
    """The piece table naming each run's remote ranges."""
    return _run_table(runs[0]) if len(runs) == 1 else b"".join(map(_run_table, runs))


def _run_table(run: Run) -> bytes:
    if run.num_pieces == 1:
        return PIECE.pack(run.remote.segment_id, *run.remote_offsets.tolist(),
                          *run.lengths.tolist())
    if run.num_pieces <= 4:  # struct beats numpy's per-call cost for a handful of pieces
        segment_id = run.remote.segment_id
        return b"".join(PIECE.pack(segment_id, offset, length) for offset, length
                        in zip(run.remote_offsets.tolist(), run.lengths.tolist(), strict=True))
    return pack_pieces(np.full(run.num_pieces, run.remote.segment_id), run.remote_offsets,
                       run.lengths)


class Compression(msgspec.Struct, frozen=True):
    """How a WRITE payload was quantized (see compression.py)."""

    scheme: str
    dtype: str
    block_elems: int


class FrameMeta(msgspec.Struct, frozen=True):
    notifications: list[bytes] = []
    compression: Compression | None = None


class QpInfo(msgspec.Struct, frozen=True):
    """One side of an RDMA RC queue-pair connection, exchanged over the TCP handshake."""

    qp_num: int
    psn: int
    lid: int
    gid: str
    mtu: int


class Hello(msgspec.Struct, frozen=True):
    engine_id: str
    challenge: bytes
    mac: bytes


class Welcome(msgspec.Struct, frozen=True):
    endpoint: TransferEndpoint
    mac: bytes


class ErrorBody(msgspec.Struct, frozen=True):
    kind: ErrorKind
    message: str


def sign(secret: bytes, challenge: bytes, engine_id: str) -> bytes:
    return hmac.new(secret, challenge + engine_id.encode(), hashlib.sha256).digest()


def is_signed(secret: bytes, challenge: bytes, engine_id: str, mac: bytes) -> bool:
    return hmac.compare_digest(sign(secret, challenge, engine_id), mac)


encode = msgspec.msgpack.encode


def decode(data: bytes | memoryview, kind: type[T]) -> T:
    try:
        return msgspec.msgpack.decode(data, type=kind)
    except msgspec.DecodeError as error:
        raise ProtocolViolation(f"malformed {kind.__name__}: {error}") from error
