"""The TCP transport: pooled, authenticated connections to each peer, and the inbound server.

Outbound, each connection is a `Link` (tcp_link.py: writes merged into one frame per turn of
the loop, a failed or stalled link closed with a typed error for each transfer on it). A
batch of at least `stripe_min_bytes` is cut into `num_streams` stripes sent on as many
connections; inbound transfers are `TcpServer`'s (tcp_server.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Awaitable, Callable, Sequence

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine import compression, sock_io, wire
from transfer_engine.batch import Run, stripe
from transfer_engine.config import TcpOptions
from transfer_engine.errors import (
    AuthenticationRefused,
    PeerRestarted,
    ProtocolViolation,
    TransferFailed,
    TransferTimeout,
)
from transfer_engine.memory import LocalMemory
from transfer_engine.segment import Segment
from transfer_engine.tcp_link import Job, Link, TcpStats, error_from, least_loaded
from transfer_engine.tcp_server import TcpServer
from transfer_engine.transport import Deliver, Plan


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
             payload: list[bytes] | None = None) -> Job:
        return Job(op, runs, self._loop.create_future(), list(notifications), compress,
                    payload)

    def _num_stripes(self, num_bytes: int) -> int:
        return self._options.num_streams if num_bytes >= self._options.stripe_min_bytes else 1

    def _submit(self, peer: TransferEndpoint, timeout_s: float, job: Job) -> Awaitable[None]:
        """One job: on a live link it goes at once and its future is what to await;
        otherwise a link is opened first (`_run`)."""
        link = self._live_link(peer)
        if link is None:
            return self._run(peer, timeout_s, [job])
        job.timeout_s, job.deadline = timeout_s, self._loop.time() + timeout_s
        link.submit(job)
        return job.future

    async def _run(self, peer: TransferEndpoint, timeout_s: float, jobs: list[Job]) -> None:
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
        return least_loaded(live) if live else None

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
            return [least_loaded(links)]
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
            raise error_from(wire.decode(body, wire.ErrorBody), "peer")
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
