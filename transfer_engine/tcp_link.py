"""One outbound TCP connection to a peer (`Link`) and the frames it carries.

A `Link` is a `FrameStream` (frame_stream.py): driven by the event loop's callbacks, no task
per connection. A write to an idle link is sent at once; writes submitted while frames are
in flight are merged into one WRITE frame at the end of that turn of the loop (one piece
table, one payload sent with one vectored `sendmsg`), so many small requests to one peer
cost one round trip. Each transfer is a `Job` whose future its caller awaits; a link that
fails or stalls is closed and every job on it fails with a typed error.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections import deque
from dataclasses import dataclass

from transfer_engine import wire
from transfer_engine.batch import Run
from transfer_engine.errors import (
    AuthenticationRefused,
    InvalidTransfer,
    ProtocolViolation,
    TransferFailed,
    TransferTimeout,
)
from transfer_engine.frame_stream import FrameStream

_MERGE_MAX_BYTES = 4 << 20
_HEADER_BYTES = wire.HEADER.size
_ACK = int(wire.Op.ACK)  # a plain int: compared on every answer


@dataclass
class TcpStats:
    """Counters of the outbound side, for metrics and tests."""

    num_frames_sent: int = 0
    num_transfers_sent: int = 0  # > num_frames_sent when writes were merged
    num_links_opened: int = 0


class Job:
    """One transfer's frame on a link, and the future its caller awaits."""

    __slots__ = ("compression", "deadline", "future", "meta", "notifications", "op", "payload",
                 "reply", "runs", "timeout_s")

    def __init__(self, op: wire.Op, runs: list[Run], future: asyncio.Future[None],
                 notifications: list[bytes], compression: wire.Compression | None = None,
                 payload: list[bytes] | None = None) -> None:
        self.op = op
        self.runs = runs
        self.future = future
        self.notifications = notifications
        self.compression = compression
        self.payload = payload  # compressed pieces, when compressing
        self.meta = b""  # the body of a control request (RDMA_CONNECT)
        self.reply = b""  # the body of its ACK
        self.timeout_s = 0.0
        self.deadline = 0.0  # event-loop time by which it must be answered

    @property
    def is_mergeable(self) -> bool:
        return self.op == wire.Op.WRITE and self.compression is None

    @property
    def is_plain_write(self) -> bool:
        """A WRITE with nothing but its pieces: no compression, no notifications."""
        return self.op == wire.Op.WRITE and self.compression is None and not self.notifications

    @property
    def num_bytes(self) -> int:
        return sum(run.num_bytes for run in self.runs)

    def payload_views(self) -> list[memoryview | bytes]:
        if self.payload is not None:
            return list(self.payload)
        if len(self.runs) == 1:
            return self.runs[0].local_views()
        return [view for run in self.runs for view in run.local_views()]


class Link(FrameStream):
    """One authenticated connection to a peer. A transfer submitted to an idle link goes out at
    once; while frames are in flight, those submitted in one turn of the event loop go out as
    one frame at the end of that turn (merged, when they are plain writes). Answers are parsed
    as they arrive (frame_stream.py)."""

    def __init__(self, sock: socket.socket, peer_id: str, stats: TcpStats) -> None:
        super().__init__(sock)
        self.peer_id = peer_id
        self._stats = stats
        self._queue: deque[Job] = deque()
        self._pending: dict[int, list[Job]] = {}
        self._request_ids = itertools.count(1)
        self._header_bytes = memoryview(bytearray(wire.HEADER.size))
        self._on_header_step = self._on_header  # one bound method: `skim` knows the step by it
        self._is_flush_due = False
        self._timer: asyncio.TimerHandle | None = None  # the earliest deadline of a job here
        self.error: TransferFailed | None = None

    @property
    def is_alive(self) -> bool:
        return self.error is None

    @property
    def num_queued_bytes(self) -> int:
        jobs = itertools.chain(self._queue, *self._pending.values())
        return sum(job.num_bytes for job in jobs)

    def submit(self, job: Job) -> None:
        if self.error is not None:
            job.future.set_exception(self.error)
            return
        if self._timer is None or job.deadline < self._timer.when():
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(job.deadline, self._expire)
        if not self._pending and not self._queue and not self._is_write_paused:
            self._send_frame([job])  # an idle link: send at once
            return
        self._queue.append(job)
        if not self._pending and not self._is_flush_due:
            self._flush()
        elif not self._is_flush_due:
            # Frames are in flight: what else is submitted in this turn of the loop joins
            # this one (a round trip per burst, not per transfer).
            self._is_flush_due = True
            self._loop.call_soon(self._flush)

    def close(self, error: TransferFailed) -> None:
        """Close the connection and fail every transfer queued or in flight on it."""
        if self.error is not None:
            return
        self.error = error
        if self._timer is not None:
            self._timer.cancel()
        self.abort()
        jobs = self._jobs()
        self._queue.clear()
        self._pending.clear()
        _settle(jobs, error)

    def _expire(self) -> None:
        """A deadline came: a transfer not answered by its deadline fails the link (it may be
        mid-frame; no later transfer can use it). One timer per link, not one per transfer:
        it re-arms for the earliest deadline still pending."""
        self._timer = None
        jobs = self._jobs()
        now = self._loop.time()
        late = next((job for job in jobs if job.deadline <= now), None)
        if late is not None:
            self.close(TransferTimeout(f"transfer to {self.peer_id!r} did not finish within "
                                       f"{late.timeout_s:g} s"))
        elif jobs:
            self._timer = self._loop.call_at(min(job.deadline for job in jobs), self._expire)

    def _jobs(self) -> list[Job]:
        """Every transfer on this link: queued, then in flight."""
        return [*self._queue, *itertools.chain(*self._pending.values())]

    # --- FrameStream -----------------------------------------------------------------------

    def start(self) -> None:
        self._next_frame()
        super().start()

    def connection_lost(self, error: Exception | None) -> None:
        self.close(TransferFailed(f"connection to {self.peer_id!r} lost: "
                                  f"{error or 'closed'}"))

    def resume_writing(self) -> None:
        self._flush()  # what was submitted while the output queue was full

    # --- sending ---------------------------------------------------------------------------

    def _flush(self) -> None:
        self._is_flush_due = False
        while self._queue and not self._is_write_paused and self.error is None:
            self._send_frame(self._take_frame())

    def _send_frame(self, jobs: list[Job]) -> None:
        request_id = next(self._request_ids)
        self._pending[request_id] = jobs
        self._stats.num_frames_sent += 1
        self._stats.num_transfers_sent += len(jobs)
        self.send_frame(*_frame(request_id, jobs))

    def _take_frame(self) -> list[Job]:
        jobs = [self._queue.popleft()]
        if not self._queue or not jobs[0].is_mergeable:
            return jobs
        num_bytes = jobs[0].num_bytes
        while (self._queue and self._queue[0].is_mergeable
               and num_bytes + self._queue[0].num_bytes <= _MERGE_MAX_BYTES):
            num_bytes += self._queue[0].num_bytes
            jobs.append(self._queue.popleft())
        return jobs

    # --- receiving the answers -------------------------------------------------------------

    def skim(self, data: memoryview) -> memoryview:
        """Plain ACKs (most answers) settle their transfers straight from the received bytes;
        anything else goes through the steps."""
        if self._then is not self._on_header_step or self._left != _HEADER_BYTES:
            return data  # inside a frame
        pending = self._pending
        while len(data) >= _HEADER_BYTES:
            magic, version, op, _, request_id, _, meta_len, payload_len = (
                wire.HEADER.unpack_from(data))
            if (op != _ACK or meta_len or payload_len or magic != wire.MAGIC
                    or version != wire.VERSION or request_id not in pending):
                break  # the steps parse it (and refuse what is wrong)
            _settle(pending.pop(request_id), None)
            data = data[_HEADER_BYTES:]
        return data

    def _next_frame(self) -> None:
        self.expect([self._header_bytes], self._on_header_step)

    def _on_header(self) -> None:
        try:
            header = wire.unpack_header(self._header_bytes)
            jobs = self._pending.get(header.request_id)
            if header.op == wire.Op.ERROR:
                body = memoryview(bytearray(header.meta_len))
                self.expect([body], lambda: self._on_error(header, bytes(body)))
            elif jobs is None or header.op not in (wire.Op.ACK, wire.Op.DATA):
                raise ProtocolViolation(f"unexpected {header.op.name} for request "
                                        f"{header.request_id} from {self.peer_id!r}")
            elif header.op == wire.Op.ACK and not header.meta_len:
                self._answered(header.request_id)
            elif header.op == wire.Op.DATA:
                views = [view for run in jobs[0].runs for view in run.local_views()]
                if header.payload_len != sum(view.nbytes for view in views):
                    raise ProtocolViolation(f"{self.peer_id!r} answered a read with "
                                            f"{header.payload_len} bytes")
                self.expect(views, lambda: self._answered(header.request_id))
            else:
                reply = memoryview(bytearray(header.meta_len))
                self.expect([reply], lambda: self._answered(header.request_id, bytes(reply)))
        except TransferFailed as error:
            self.close(error)

    def _on_error(self, header: wire.Header, meta: bytes) -> None:
        try:
            body = wire.decode(meta, wire.ErrorBody)
        except ProtocolViolation as error:
            self.close(error)
            return
        error = error_from(body, self.peer_id)
        if body.kind != wire.ErrorKind.INVALID or header.request_id not in self._pending:
            self.close(error)
            return
        _settle(self._pending.pop(header.request_id), error)
        self._next_frame()

    def _answered(self, request_id: int, reply: bytes = b"") -> None:
        jobs = self._pending.pop(request_id)
        jobs[0].reply = reply
        _settle(jobs, None)
        self._next_frame()


def least_loaded(links: list[Link]) -> Link:
    return min(links, key=lambda link: link.num_queued_bytes)


def _settle(jobs: list[Job], error: Exception | None) -> None:
    for job in jobs:
        if job.future.done():
            continue
        if error is None:
            job.future.set_result(None)
        else:
            job.future.set_exception(error)


def error_from(body: wire.ErrorBody, peer_id: str) -> TransferFailed:
    message = f"{peer_id!r} refused: {body.message}"
    match body.kind:
        case wire.ErrorKind.INVALID:
            return InvalidTransfer(message)
        case wire.ErrorKind.AUTH:
            return AuthenticationRefused(message)
        case wire.ErrorKind.PROTOCOL:
            return ProtocolViolation(message)
        case _:
            return TransferFailed(message)


def _frame(request_id: int, jobs: list[Job]) -> tuple[list[memoryview | bytes],
                                                     list[memoryview | bytes]]:
    """A frame's head (header, piece table, meta) and its payload."""
    first = jobs[0]
    if len(jobs) == 1 and first.is_plain_write and len(first.runs) == 1:
        run = first.runs[0]
        if len(run.lengths) == 1:  # one piece (a layer, say): packed at once
            (local_offset,), (remote_offset,), (length,) = (
                run.local_offsets.tolist(), run.remote_offsets.tolist(), run.lengths.tolist())
            return ([wire.write_one_head(request_id, run.remote.segment_id, remote_offset,
                                         length)],
                    [run.local.data[local_offset:local_offset + length]])
    if first.op == wire.Op.RDMA_CONNECT:
        return [wire.Header(first.op, request_id, meta_len=len(first.meta)).pack(),
                first.meta], []
    if len(jobs) == 1:
        runs, notifications = first.runs, first.notifications
    else:  # merged writes
        runs = [run for job in jobs for run in job.runs]
        notifications = [note for job in jobs for note in job.notifications]
    table = wire.table_of(runs)
    if first.op in (wire.Op.READ, wire.Op.STAGE):
        return [wire.Header(first.op, request_id, len(table) // wire.PIECE.size).pack(),
                table], []
    payload: list[memoryview | bytes] = []  # NOTIFY names pieces written one-sidedly
    if first.op == wire.Op.WRITE:
        payload = first.payload_views() if len(jobs) == 1 else [
            view for job in jobs for view in job.payload_views()]
    meta = (wire.encode(wire.FrameMeta(notifications, first.compression))
            if notifications or first.compression else b"")
    header = wire.Header(first.op, request_id, num_pieces=len(table) // wire.PIECE.size,
                         meta_len=len(meta), payload_len=sum(map(len, payload)))
    return [header.pack(), table, meta] if meta else [header.pack(), table], payload


