"""The TCP transport: pooled, authenticated connections to each peer, and the inbound server.

Outbound, each connection (`Link`) is a `FrameStream` (frame_stream.py): driven by the event
loop's callbacks, no task per connection. A write to an idle link is sent at once; writes
submitted while frames are in flight are merged into one WRITE frame at the end of that turn
of the loop (one piece table, one payload sent with one vectored `sendmsg`), so many small
requests to one peer cost one round trip. A batch of at least `stripe_min_bytes` is cut into
`num_streams` stripes sent on as many connections.
A link that fails or stalls is closed and every transfer on it fails with a typed error.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine import compression, sock_io, wire
from transfer_engine.batch import Run, stripe
from transfer_engine.config import TcpOptions
from transfer_engine.errors import (
    AuthenticationRefused,
    InvalidTransfer,
    PeerRestarted,
    ProtocolViolation,
    TransferFailed,
    TransferTimeout,
)
from transfer_engine.frame_stream import FrameStream
from transfer_engine.memory import LocalMemory
from transfer_engine.segment import Segment
from transfer_engine.tcp_server import TcpServer
from transfer_engine.transport import Deliver, Plan

log = structlog.get_logger(__name__)

_MERGE_MAX_BYTES = 4 << 20
_HEADER_BYTES = wire.HEADER.size
_ACK = int(wire.Op.ACK)  # a plain int: compared on every answer


@dataclass
class TcpStats:
    """Counters of the outbound side, for metrics and tests."""

    num_frames_sent: int = 0
    num_transfers_sent: int = 0  # > num_frames_sent when writes were merged
    num_links_opened: int = 0


class _Job:
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
        self._queue: deque[_Job] = deque()
        self._pending: dict[int, list[_Job]] = {}
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

    def submit(self, job: _Job) -> None:
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

    def _jobs(self) -> list[_Job]:
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

    def _send_frame(self, jobs: list[_Job]) -> None:
        request_id = next(self._request_ids)
        self._pending[request_id] = jobs
        self._stats.num_frames_sent += 1
        self._stats.num_transfers_sent += len(jobs)
        self.send_frame(*_frame(request_id, jobs))

    def _take_frame(self) -> list[_Job]:
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
        error = _error_from(body, self.peer_id)
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


def _least_loaded(links: list[Link]) -> Link:
    return min(links, key=lambda link: link.num_queued_bytes)


def _settle(jobs: list[_Job], error: Exception | None) -> None:
    for job in jobs:
        if job.future.done():
            continue
        if error is None:
            job.future.set_result(None)
        else:
            job.future.set_exception(error)


def _error_from(body: wire.ErrorBody, peer_id: str) -> TransferFailed:
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


def _frame(request_id: int, jobs: list[_Job]) -> tuple[list[memoryview | bytes],
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


class TcpTransport:
    """Carries transfers over TCP and serves peers' transfers into local memory."""

    name = "tcp"
    is_one_sided = False

    def __init__(self, engine_id: str, secret: bytes, memory: LocalMemory, deliver: Deliver,
                 endpoint: Callable[[], TransferEndpoint], options: TcpOptions) -> None:
        self._engine_id = engine_id
        self._secret = secret
        self._options = options
        self._server = TcpServer(secret, memory, deliver, endpoint, options.frame_timeout_s)
        self._links: dict[str, list[Link]] = {}
        self.stats = TcpStats()
        self._connecting: dict[str, asyncio.Lock] = {}
        self._loop = asyncio.get_running_loop()  # made by `TransferEngine.start`

    async def start(self, host: str, port: int) -> int:
        return await self._server.start(host, port)

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return True

    def write(self, plan: Plan) -> Awaitable[None]:
        """Send the plan's pieces; what to await is the answer's future itself when one link
        takes them (`_submit`), so a layer-sized write costs no coroutine here."""
        if plan.compression is None and self._num_stripes(plan.num_bytes) == 1:
            return self._submit(plan.peer, plan.timeout_s,
                                self._job(wire.Op.WRITE, plan.runs, plan.notifications))
        return self._write_parts(plan)

    async def _write_parts(self, plan: Plan) -> None:
        """A compressed write (quantized off the loop first), or one cut into stripes."""
        if plan.compression is not None:
            payload = await asyncio.to_thread(_compress_all, plan.runs, plan.compression)
            await self._submit(plan.peer, plan.timeout_s, self._job(
                wire.Op.WRITE, plan.runs, plan.notifications, plan.compression, payload))
            return
        jobs = [self._job(wire.Op.WRITE, part)
                for part in stripe(plan.runs, self._options.num_streams)]
        if len(jobs) == 1:
            jobs[0].notifications = list(plan.notifications)
        await self._run(plan.peer, plan.timeout_s, jobs)
        if plan.notifications and len(jobs) > 1:
            # Stripes land on different connections in any order; the notification must
            # follow all of them, so it goes once every stripe is acknowledged.
            await self.notify(plan.peer, plan.notifications, plan.timeout_s)

    def read(self, plan: Plan) -> Awaitable[None]:
        num_stripes = self._num_stripes(plan.num_bytes)
        if num_stripes == 1:
            return self._submit(plan.peer, plan.timeout_s, self._job(wire.Op.READ, plan.runs))
        return self._run(plan.peer, plan.timeout_s, [
            self._job(wire.Op.READ, part) for part in stripe(plan.runs, num_stripes)])

    async def notify(self, peer: TransferEndpoint, notifications: list[bytes],
                     timeout_s: float, written: Sequence[Run] = ()) -> None:
        """Deliver notifications after a one-sided transfer by another transport, naming
        the pieces it wrote into the peer's staged segments (`written`), which the peer
        moves from their mirrors to their devices first."""
        await self._submit(peer, timeout_s, self._job(wire.Op.NOTIFY, list(written),
                                                      notifications))

    async def stage(self, peer: TransferEndpoint, runs: Sequence[Run], timeout_s: float) -> None:
        """Have the peer copy these pieces of its staged segments from their devices to their
        mirrors (before another transport reads the mirrors one-sidedly)."""
        await self._submit(peer, timeout_s, self._job(wire.Op.STAGE, list(runs)))

    async def request(self, peer: TransferEndpoint, op: wire.Op, meta: bytes,
                      timeout_s: float) -> bytes:
        """Send one control request on a link to `peer`; return the body of its ACK."""
        job = self._job(op, [])
        job.meta = meta
        await self._submit(peer, timeout_s, job)
        return job.reply

    @property
    def server(self) -> TcpServer:
        return self._server

    def _job(self, op: wire.Op, runs: list[Run], notifications: Sequence[bytes] = (),
             compress: wire.Compression | None = None,
             payload: list[bytes] | None = None) -> _Job:
        return _Job(op, runs, self._loop.create_future(), list(notifications), compress,
                    payload)

    def _num_stripes(self, num_bytes: int) -> int:
        return self._options.num_streams if num_bytes >= self._options.stripe_min_bytes else 1

    def _submit(self, peer: TransferEndpoint, timeout_s: float, job: _Job) -> Awaitable[None]:
        """One job: on a live link it goes at once and its future is what to await;
        otherwise a link is opened first (`_run`)."""
        link = self._live_link(peer)
        if link is None:
            return self._run(peer, timeout_s, [job])
        job.timeout_s, job.deadline = timeout_s, self._loop.time() + timeout_s
        link.submit(job)
        return job.future

    async def _run(self, peer: TransferEndpoint, timeout_s: float, jobs: list[_Job]) -> None:
        """Submit the jobs on links to `peer`, opening them as needed, and wait for their
        answers; a job unanswered after `timeout_s` closes its link (`Link._expire`) and
        fails with `TransferTimeout`."""
        deadline = self._loop.time() + timeout_s
        for job in jobs:
            job.timeout_s, job.deadline = timeout_s, deadline
        try:
            links = await self._links_to(peer, len(jobs), timeout_s)
        except TimeoutError:
            raise TransferTimeout(f"transfer to {peer.engine_id!r} did not finish within "
                                  f"{timeout_s:g} s (no connection)") from None
        for job, link in zip(jobs, links, strict=False):
            link.submit(job)
        for job in jobs:
            await job.future

    def _live_link(self, peer: TransferEndpoint) -> Link | None:
        """A live link to `peer`, at once (the least loaded, if there are several)."""
        links = self._links.get(peer.engine_id)
        if links and len(links) == 1:
            return links[0] if links[0].is_alive else None
        live = self._live_links(peer)
        return _least_loaded(live) if live else None

    def _live_links(self, peer: TransferEndpoint) -> list[Link]:
        return [link for link in self._links.get(peer.engine_id, ()) if link.is_alive]

    async def _links_to(self, peer: TransferEndpoint, count: int,
                        timeout_s: float) -> list[Link]:
        """`count` live links to `peer`, least loaded first, opening new ones as needed."""
        lock = self._connecting.setdefault(peer.engine_id, asyncio.Lock())
        async with lock:
            links = self._live_links(peer)
            want = min(max(count, 1), self._options.num_streams)
            missing = max(want - len(links), 0)
            async with asyncio.timeout(timeout_s):
                links += await asyncio.gather(*(self._connect(peer) for _ in range(missing)))
            self._links[peer.engine_id] = links
        if count == 1:
            return [_least_loaded(links)]
        return links[:count]

    async def _connect(self, peer: TransferEndpoint) -> Link:
        sock, endpoint = await self.handshake(peer.tcp_host, peer.tcp_port)
        if endpoint.engine_id != peer.engine_id:
            sock.close()
            raise TransferFailed(f"{peer.tcp_host}:{peer.tcp_port} is {endpoint.engine_id!r}, "
                                 f"not {peer.engine_id!r}")
        if peer.incarnation and endpoint.incarnation != peer.incarnation:
            sock.close()  # the same id at the same address, another process
            raise PeerRestarted(f"{peer.engine_id!r} at {peer.tcp_host}:{peer.tcp_port} "
                                f"restarted (incarnation {endpoint.incarnation or 'unknown'}, "
                                f"not {peer.incarnation})")
        link = Link(sock, peer.engine_id, self.stats)
        link.start()
        self.stats.num_links_opened += 1
        return link

    async def handshake(self, host: str, port: int) -> tuple[socket.socket, TransferEndpoint]:
        """Connect and authenticate both ways; return the socket and the peer's descriptor
        (the direct handshake: it works without the registry)."""
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            async with asyncio.timeout(self._options.connect_timeout_s):
                await loop.sock_connect(sock, (host, port))
                endpoint = await self._authenticate(sock)
        except TimeoutError:
            sock.close()
            raise TransferTimeout(f"no handshake with {host}:{port} within "
                                  f"{self._options.connect_timeout_s:g} s") from None
        except (OSError, sock_io.ConnectionClosed) as error:
            sock.close()
            raise TransferFailed(f"cannot connect to {host}:{port}: {error}") from error
        except BaseException:
            sock.close()
            raise
        return sock, endpoint

    async def _authenticate(self, sock: socket.socket) -> TransferEndpoint:
        challenge = await sock_io.recv_bytes(sock, wire.CHALLENGE_BYTES)
        mine = os.urandom(wire.CHALLENGE_BYTES)
        hello = wire.encode(wire.Hello(self._engine_id, mine,
                                       wire.sign(self._secret, challenge, self._engine_id)))
        await sock_io.send(sock, [wire.Header(wire.Op.HELLO, meta_len=len(hello)).pack(), hello])
        header = wire.unpack_header(await sock_io.recv_bytes(sock, wire.HEADER.size))
        body = await sock_io.recv_bytes(sock, header.meta_len)
        if header.op == wire.Op.ERROR:
            raise _error_from(wire.decode(body, wire.ErrorBody), "peer")
        if header.op != wire.Op.WELCOME:
            raise ProtocolViolation(f"expected WELCOME, got {header.op.name}")
        welcome = wire.decode(body, wire.Welcome)
        if not wire.is_signed(self._secret, mine, welcome.endpoint.engine_id, welcome.mac):
            raise AuthenticationRefused(
                f"peer {welcome.endpoint.engine_id!r} does not hold the shared secret")
        return welcome.endpoint

    def moves_in_place(self, segment: Segment) -> bool:
        return False  # device segments go through their mirrors

    async def close(self) -> None:
        closed = TransferFailed("transfer engine closed")
        for links in self._links.values():
            for link in links:
                link.close(closed)
        self._links.clear()
        await self._server.close()


def _compress_all(runs: list[Run], compress: wire.Compression) -> list[bytes]:
    return [compression.compress(view, compress) for run in runs for view in run.local_views()]
