"""`TransferEngine`: one per process; registers memory and moves bytes to and from peers.

Lifecycle: `TransferEngine(config, registry)` does no I/O; `await start()` listens, opens the
RDMA device if there is one, and publishes the descriptor; `register`/`allocate` add segments
(and republish); `write`/`read` resolve a batch (coalesce, bounds-check both sides), pick a
transport for the peer and await the bytes; `close()` (idempotent) releases every socket,
mapping and shared-memory name, and removes the descriptor.

    engine = TransferEngine(TransferConfig(engine_id="prefill-0", secret=b"..."), registry)
    await engine.start()
    kv = await engine.allocate("kv", 64 << 20)          # shared memory: shm peers write one-sided
    result = await engine.write("decode-0", [("kv", 0, "kv", 4096, 8192)], notify=b"req 7 L0")
    result.transport, result.num_bytes, result.seconds
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from shared.messages import SegmentInfo, TransferEndpoint
from transfer_engine import compression as quantization
from transfer_engine.batch import (
    Notification,
    PieceArrays,
    Route,
    Run,
    TransferPiece,
    TransferResult,
    group,
)
from transfer_engine.config import TransferConfig
from transfer_engine.errors import (
    AuthenticationRefused,
    InvalidTransfer,
    PeerNotFound,
    PeerRestarted,
    TransferFailed,
    TransferTimeout,
)
from transfer_engine.loopback import LoopbackTransport
from transfer_engine.memory import LocalMemory
from transfer_engine.registry import EndpointRegistry
from transfer_engine.segment import Segment, sweep_orphans
from transfer_engine.shm import ShmTransport
from transfer_engine.tcp import TcpTransport
from transfer_engine.tcp_link import TcpStats
from transfer_engine.transport import Plan, Transport
from transfer_engine.wire import Compression

log = structlog.get_logger(__name__)

TRANSPORTS = ("cuda", "rdma", "shm", "tcp", "loopback")
_UNPUBLISH_TIMEOUT_S = 1.0
Peer = str | TransferEndpoint  # an engine id, "tcp://host:port", or a descriptor
_Planned = tuple[TransferEndpoint, list[Transport], list[Run]]  # descriptor, transports, runs
Batch = Sequence[TransferPiece | tuple[str, int, str, int, int]] | PieceArrays


class TransferEngine:
    def __init__(self, config: TransferConfig, registry: EndpointRegistry | None = None,
                 on_notification: Callable[[Notification], None] | None = None) -> None:
        unknown = set(config.transports) - set(TRANSPORTS)
        if unknown or not config.transports:
            raise InvalidTransfer(f"unknown transports {sorted(unknown)}; use {TRANSPORTS}")
        if not config.secret:
            raise InvalidTransfer("a transfer engine needs a non-empty shared secret")
        self.config = config
        self._registry = registry
        self._on_notification = on_notification
        self.notifications: asyncio.Queue[Notification] = asyncio.Queue()
        self._memory = LocalMemory(config.engine_id)
        self.incarnation = os.urandom(8).hex()  # this start's: see TransferEndpoint
        self._peers: dict[str, TransferEndpoint] = {}
        self._routes: dict[tuple[str, str, str], Route] = {}
        self._transports: list[Transport] = []
        self._tcp: TcpTransport | None = None
        self._port = 0
        self._rdma_port: Any = None
        self._is_closed = False

    async def start(self) -> None:
        """Listen for peers, open the transports, publish the descriptor."""
        sweep_orphans()
        config = self.config
        tcp = TcpTransport(config.engine_id, config.secret, self._memory, self._deliver,
                           self.endpoint, config.tcp)
        self._tcp = tcp
        try:
            self._port = await tcp.start(config.listen_host, config.listen_port)
            for name in config.transports:
                transport = self._make_transport(name, tcp)
                if transport is not None:
                    self._transports.append(transport)
            await self._publish()
        except BaseException:
            await self.close()
            raise
        log.info("transfer.started", engine_id=config.engine_id, port=self._port,
                 transports=[t.name for t in self._transports])

    def _make_transport(self, name: str, tcp: TcpTransport) -> Transport | None:
        match name:
            case "tcp":
                return tcp
            case "shm":
                return ShmTransport(self.config.host_id, tcp)
            case "loopback":
                return LoopbackTransport(self.config.engine_id, self._memory, self._deliver)
            case "cuda":
                from transfer_engine import cuda_ipc

                return cuda_ipc.open_transport(self.config.host_id, tcp)
            case "rdma":
                from transfer_engine import rdma

                transport = rdma.open_transport(self.config, self._memory, tcp)
                self._rdma_port = transport.port if transport is not None else None
                return transport
        return None

    @property
    def tcp_stats(self) -> TcpStats:
        if self._tcp is None:
            raise InvalidTransfer("the transfer engine is not running")
        return self._tcp.stats

    @property
    def transport_names(self) -> list[str]:
        return [transport.name for transport in self._transports]

    def endpoint(self) -> TransferEndpoint:
        """This engine's descriptor, as published and as sent in handshakes."""
        config = self.config
        return TransferEndpoint(engine_id=config.engine_id, host_id=config.host_id,
                                tcp_host=self._advertised_host(),
                                tcp_port=self._port, segments=self._memory.infos(),
                                rdma=self._rdma_port, incarnation=self.incarnation)

    def _advertised_host(self) -> str:
        """What peers dial: the configured address, else the listening one, else (listening
        on every interface) this host's primary address."""
        config = self.config
        if config.advertise_host:
            return config.advertise_host
        if config.listen_host not in ("0.0.0.0", "::", ""):
            return config.listen_host
        return socket.gethostbyname(socket.gethostname())

    async def register(self, name: str, buffer: Any, *,
                       is_staged: bool | None = None) -> SegmentInfo:
        """Register a buffer (bytes-like, numpy array, torch tensor) that peers may address.
        Device tensors move through a pinned host mirror (staging.py): peers reach them over
        tcp only."""
        segment = self._memory.register(name, buffer, is_staged=is_staged)
        self._routes.clear()
        await self._added(segment)
        return segment.info()

    async def allocate(self, name: str, size_bytes: int) -> memoryview:
        """Allocate and register shared memory (one-sided shm writes from same-host peers);
        returns it as a writable byte view (wrap it with `torch.frombuffer` or numpy)."""
        segment = self._memory.allocate(name, size_bytes)
        self._routes.clear()
        await self._added(segment)
        return segment.data

    async def _added(self, segment: Segment) -> None:
        """Tell transports that register memory themselves (rdma), then republish."""
        for transport in self._transports:
            if hasattr(transport, "register_memory"):
                transport.register_memory(segment)
        await self._publish()

    async def unregister(self, name: str) -> None:
        self._memory.unregister(name)
        self._routes.clear()
        await self._publish()

    def write(self, peer: Peer, batch: Batch, *, notify: bytes | None = None,
              compression: Compression | None = None, timeout_s: float | None = None,
              incarnation: str | None = None) -> Coroutine[Any, Any, TransferResult]:
        """Copy each piece's local bytes into the peer's segment; return when all landed
        (and `notify`, if given, was delivered after them). With `incarnation` (the peer's,
        from the descriptor its addresses came with), a peer restarted since then raises
        `PeerRestarted` and nothing is written. (A coroutine, awaited as `async def`'s
        are, without one more frame per transfer.)"""
        notifications = [notify] if notify is not None else []
        return self._transfer(peer, batch, notifications, compression, timeout_s,
                              incarnation, is_write=True)

    def read(self, peer: Peer, batch: Batch, *, timeout_s: float | None = None,
             incarnation: str | None = None) -> Coroutine[Any, Any, TransferResult]:
        """Copy each piece of the peer's segments into local memory (a coroutine)."""
        return self._transfer(peer, batch, [], None, timeout_s, incarnation, is_write=False)

    async def _transfer(self, peer: Peer, batch: Batch, notifications: list[bytes],
                        compression: Compression | None, timeout_s: float | None,
                        incarnation: str | None, *, is_write: bool) -> TransferResult:
        if self._is_closed or self._tcp is None:
            raise InvalidTransfer("the transfer engine is not running")
        started = time.perf_counter()
        endpoint, candidates, runs = (self._cached_plan(peer, batch, is_write)
                                      or await self._plan_transfer(peer, batch, is_write))
        if incarnation and endpoint.incarnation != incarnation:
            self._forget(peer)  # a descriptor kept from before the peer restarted?
            endpoint, candidates, runs = await self._plan_transfer(peer, batch, is_write)
            if endpoint.incarnation != incarnation:
                raise PeerRestarted(f"{endpoint.engine_id!r} restarted (incarnation "
                                    f"{endpoint.incarnation or 'unknown'}, not {incarnation})")
        staged = [run for run in runs if run.local.staging is not None]
        mirrored: set[int] = set()  # ids of the runs whose device bytes are in their mirrors
        via_mirror: list[Run] = []
        # A transfer that fails on one transport is tried once more on the next one the pair
        # can use (e.g. cuda -> tcp); what is wrong with the batch itself fails at once.
        for attempt, transport in enumerate(candidates[:2]):
            plan = self._plan_for(transport, endpoint, runs, notifications, compression,
                                  timeout_s)
            if staged:
                via_mirror = [run for run in staged if not transport.moves_in_place(run.local)]
                to_mirror = [run for run in via_mirror if id(run) not in mirrored]
                if to_mirror and is_write:
                    await asyncio.to_thread(_stage, to_mirror, to_device=False)
                    mirrored.update(id(run) for run in to_mirror)
            try:
                await (transport.write(plan) if is_write else transport.read(plan))
                break
            except (TransferFailed, TransferTimeout) as exc:
                is_refused = isinstance(exc, InvalidTransfer | AuthenticationRefused)
                if attempt + 1 >= min(2, len(candidates)) or self._is_closed or is_refused:
                    if not is_refused:
                        self._forget(peer)  # gone, or restarted: look it up next time
                    raise
                log.warning("transfer.retry_on_next_transport", peer=endpoint.engine_id,
                            failed=transport.name, next=candidates[attempt + 1].name,
                            error=repr(exc))
        if via_mirror and not is_write:
            await asyncio.to_thread(_stage, via_mirror, to_device=True)
        wire_bytes = plan.num_bytes
        if plan.compression is not None:
            wire_bytes = sum(quantization.compressed_size(length, plan.compression)
                             for run in runs for length in run.lengths.tolist())
        return TransferResult(num_bytes=plan.num_bytes, seconds=time.perf_counter() - started,
                              transport=transport.name, num_pieces=plan.num_pieces,
                              compression=plan.compression.scheme if plan.compression
                              else None, wire_bytes=wire_bytes)

    def _cached_plan(self, peer: Peer, batch: Batch, is_write: bool) -> _Planned | None:
        """The common case at once: one pair of segments, on a route already known."""
        if type(batch) is not PieceArrays or type(peer) is not str:
            return None
        route = self._routes.get((peer, batch.local_segment, batch.remote_segment))
        return None if route is None else _planned(route, batch, is_write)

    async def _plan_transfer(self, peer: Peer, batch: Batch, is_write: bool) -> _Planned:
        """The peer's descriptor, the transports that reach every segment of the batch, and
        its runs (one per pair of segments)."""
        if type(batch) is PieceArrays:
            return _planned(await self._route(peer, batch), batch, is_write)
        return await self._plan_pieces(peer, batch, is_write)

    async def _plan_pieces(self, peer: Peer, batch: Batch, is_write: bool) -> _Planned:
        """A batch's runs (one per pair of segments) and the transports that reach all."""
        groups = group(batch)
        routes = [self._cached_route(peer, pieces) or await self._route(peer, pieces)
                  for pieces in groups]
        runs = [run for route, pieces in zip(routes, groups, strict=True)
                if (run := route.plan(pieces, is_read=not is_write)) is not None]
        if not routes:  # no pieces (a notification alone, say): any transport to the peer
            endpoint = await self._resolve(peer, set())
            return endpoint, self._reaching(endpoint, []), runs
        endpoint, candidates = self._reach(routes)
        return endpoint, candidates, runs

    def _plan_for(self, transport: Transport, endpoint: TransferEndpoint, runs: list[Run],
                  notifications: list[bytes], compression: Compression | None,
                  timeout_s: float | None) -> Plan:
        if transport.is_one_sided:
            compression = None
        if compression is not None:
            for run in runs:
                quantization.check_lengths(run.lengths, compression)
        return Plan(endpoint, runs, notifications, compression,
                    timeout_s or self.config.timeout_s)

    def _cached_route(self, peer: Peer, pieces: PieceArrays) -> Route | None:
        if not isinstance(peer, str):
            return None
        return self._routes.get((peer, pieces.local_segment, pieces.remote_segment))

    async def _route(self, peer: Peer, pieces: PieceArrays) -> Route:
        """How to reach `pieces.remote_segment` of `peer` from `pieces.local_segment`; kept
        (`_cached_route`) per (peer, segments) until the peer's descriptor or our segments
        change."""
        endpoint = await self._resolve(peer, {pieces.remote_segment})
        remote = next((info for info in endpoint.segments
                       if info.name == pieces.remote_segment), None)
        if remote is None:
            raise InvalidTransfer(f"{endpoint.engine_id!r} has no segment "
                                  f"{pieces.remote_segment!r}")
        route = Route(endpoint, self._memory.get(pieces.local_segment), remote,
                      self._reaching(endpoint, [remote]))
        if isinstance(peer, str):
            self._routes[(peer, pieces.local_segment, pieces.remote_segment)] = route
        return route

    def _reach(self, routes: list[Route]) -> tuple[TransferEndpoint, list[Transport]]:
        """The peer's descriptor and the transports that reach every segment of a batch."""
        if len(routes) == 1:
            return routes[0].endpoint, routes[0].candidates
        candidates = [transport for transport in routes[0].candidates
                      if all(transport in route.candidates for route in routes)]
        if not candidates:
            raise PeerNotFound(f"no transport of {self.transport_names} reaches every segment"
                               f" of {routes[0].endpoint.engine_id!r} in this batch")
        return routes[0].endpoint, candidates

    async def _resolve(self, peer: Peer, segment_names: set[str]) -> TransferEndpoint:
        if isinstance(peer, TransferEndpoint):
            return peer
        known = self._peers.get(peer)
        if known is not None and segment_names <= {s.name for s in known.segments}:
            return known
        endpoint = await self._look_up(peer)
        self._peers[peer] = endpoint
        self._routes.clear()
        return endpoint

    def _forget(self, peer: Peer) -> None:
        """Drop what is known of `peer` (its descriptor and routes): the next transfer looks
        it up again."""
        if isinstance(peer, str) and self._peers.pop(peer, None) is not None:
            self._routes = {key: route for key, route in self._routes.items()
                            if key[0] != peer}

    async def _look_up(self, peer: str) -> TransferEndpoint:
        if peer.startswith("tcp://"):
            host, _, port = peer.removeprefix("tcp://").rpartition(":")
            if not port.isdigit():
                raise PeerNotFound(f"bad peer address {peer!r}; use tcp://host:port")
            return await self.connect(host.strip("[]"), int(port))
        endpoint = await self._registry.get(peer) if self._registry is not None else None
        if endpoint is None:
            raise PeerNotFound(f"no transfer engine {peer!r} is registered")
        return endpoint

    async def stop_listening(self) -> None:
        """Close the TCP listener and every inbound connection: peers can no longer land bytes
        or notifications here (the memory stays mapped and outbound transfers still work).
        For draining, and for fault drills."""
        if self._tcp is not None:
            await self._tcp.server.close()

    async def connect(self, host: str, port: int) -> TransferEndpoint:
        """The direct handshake: authenticate with the engine at host:port and learn its
        descriptor without any registry."""
        if self._tcp is None:
            raise InvalidTransfer("the transfer engine is not running")
        sock, endpoint = await self._tcp.handshake(host, port)
        sock.close()
        self._peers[endpoint.engine_id] = endpoint
        self._routes.clear()
        return endpoint

    def _reaching(self, endpoint: TransferEndpoint, remote: list[SegmentInfo]
                  ) -> list[Transport]:
        """The transports that reach these segments of the peer, in preference order."""
        reaching = [t for t in self._transports if t.can_reach(endpoint, remote)]
        if not reaching:
            raise PeerNotFound(f"no transport of {self.transport_names} reaches "
                               f"{endpoint.engine_id!r}")
        return reaching

    def _deliver(self, peer_id: str, payloads: list[bytes]) -> None:
        for payload in payloads:
            notification = Notification(peer_id=peer_id, payload=payload)
            if self._on_notification is not None:
                self._on_notification(notification)
            else:
                self.notifications.put_nowait(notification)

    async def _publish(self) -> None:
        if self._registry is not None and self._tcp is not None and not self._is_closed:
            await self._registry.put(self.endpoint())

    async def close(self) -> None:
        """Release every socket, mapping and shared-memory name; idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        for transport in reversed(self._transports):
            if transport is not self._tcp:
                await transport.close()
        if self._tcp is not None:
            await self._tcp.close()
        self._transports.clear()
        self._memory.close()
        if self._registry is not None:
            try:  # briefly: at shutdown NATS may be gone already
                await asyncio.wait_for(self._registry.delete(self.config.engine_id),
                                       _UNPUBLISH_TIMEOUT_S)
            except Exception as error:  # then the next engine with this id overwrites it
                log.warning("transfer.unpublish_failed", error=str(error))
        log.info("transfer.closed", engine_id=self.config.engine_id)


def _planned(route: Route, batch: PieceArrays, is_write: bool) -> _Planned:
    run = route.plan(batch, is_read=not is_write)
    return route.endpoint, route.candidates, [] if run is None else [run]


def _stage(runs: list[Run], *, to_device: bool) -> None:
    for run in runs:
        assert run.local.staging is not None  # the caller picked staged runs
        move = run.local.staging.to_device if to_device else run.local.staging.to_host
        move(run.local_offsets, run.lengths)
