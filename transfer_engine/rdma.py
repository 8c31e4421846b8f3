"""The RDMA transport, on pyverbs (rdma-core's Python bindings): RC queue pairs, RDMA WRITE
and READ straight between registered memory regions, completions polled off the event loop.

Set-up: every registered segment becomes a memory region (its address and rkey go into the
descriptor). The first transfer to a peer creates an RC queue pair and exchanges its number,
PSN, LID and GID with the peer over the authenticated TCP connection (RDMA_CONNECT); both
sides walk their QP to RTS. A batch is posted as one work request per piece, only the last of
each window signaled; on RC its completion means every earlier one landed. Notifications then
go over TCP, after the data. A completion error or a timeout destroys the QP (its state is
unknown) and the next transfer builds a new one.

Hardware status: no machine this was written on has an RDMA device (and soft-RoCE needs a
kernel with InfiniBand). Device detection and the construction of work requests and queue
pair attributes run against the real pyverbs in the tests; posting, completions and the QP
state walk have not run on a device.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from typing import TYPE_CHECKING, Any

import structlog

from shared.messages import RdmaPort, SegmentInfo, TransferEndpoint
from transfer_engine import wire
from transfer_engine.batch import Run
from transfer_engine.config import TransferConfig
from transfer_engine.errors import TransferFailed, TransferTimeout
from transfer_engine.memory import LocalMemory
from transfer_engine.segment import Segment
from transfer_engine.transport import Plan

if TYPE_CHECKING:
    from transfer_engine.tcp import TcpTransport

log = structlog.get_logger(__name__)

_MAX_SEND_WR = 1024
_CQ_DEPTH = 4096
_SPIN_POLLS = 200  # empty polls before the poller starts sleeping between polls


def pyverbs_module() -> Any | None:
    try:
        import pyverbs.device
    except ImportError:
        return None
    return pyverbs.device


def detect_devices() -> list[str]:
    """Names of the RDMA devices present; empty without pyverbs or without devices
    (`get_device_list()` raises rather than return an empty list when there are none)."""
    device = pyverbs_module()
    if device is None:
        return []
    from pyverbs.pyverbs_error import PyverbsError

    try:
        return [_text(found.name) for found in device.get_device_list()]
    except PyverbsError:
        return []


def open_transport(config: TransferConfig, memory: LocalMemory,
                   tcp: TcpTransport) -> RdmaTransport | None:
    """The RDMA transport on the configured (or first) device, or None if there is none."""
    devices = detect_devices()
    if not devices:
        log.info("transfer.rdma_unavailable",
                 reason="pyverbs not installed" if pyverbs_module() is None else "no device")
        return None
    name = config.rdma_device or devices[0]
    if name not in devices:
        raise TransferFailed(f"RDMA device {name!r} not found; present: {devices}")
    return RdmaTransport(name, config, memory, tcp)


class RdmaTransport:
    name = "rdma"
    is_one_sided = True

    def __init__(self, device_name: str, config: TransferConfig, memory: LocalMemory,
                 tcp: TcpTransport) -> None:
        from pyverbs.cq import CQ
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self._tcp = tcp
        self._port_num = config.rdma_port_num
        self._gid_index = config.rdma_gid_index
        self._ctx = Context(name=device_name)
        self._pd = PD(self._ctx)
        self._cq = CQ(self._ctx, _CQ_DEPTH)
        port = self._ctx.query_port(self._port_num)
        self._mtu = int(port.active_mtu)
        gid = self._ctx.query_gid(self._port_num, self._gid_index)
        self.port = RdmaPort(device=device_name, port_num=self._port_num, lid=int(port.lid),
                             gid=str(gid))
        self._regions: list[tuple[int, int, Any]] = []  # (start, end, MR)
        # Device segments registered where they are (GPUDirect RDMA): id -> device address.
        self._on_device: dict[int, int] = {}
        # (peer id, its incarnation) -> QP we post on: one restarted under the same id has
        # new queue pairs and memory keys, and the old QP would only fail after its retries.
        self._qps: dict[tuple[str, str], Any] = {}
        self._passive: dict[str, Any] = {}  # peer id -> QP a peer posts on
        self._connecting: dict[str, asyncio.Lock] = {}
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._wr_ids = itertools.count(1)
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, name="rdma-cq", daemon=True)
        self._loop = asyncio.get_running_loop()
        for segment in memory.segments():
            self.register_memory(segment)
        tcp.server.accept_rdma = self._accept
        self._poller.start()

    def register_memory(self, segment: Segment) -> None:
        """Register the segment as a memory region; its descriptor then carries addr/rkey.
        GPU memory is registered where it is when the NIC can reach it (GPUDirect RDMA:
        the nvidia-peermem module), and peers then write and read the device directly."""
        from pyverbs.mr import MR

        if self._register_on_device(segment):
            return
        start = segment.address
        region = MR(self._pd, segment.size_bytes, _access_flags(), address=start)
        self._regions.append((start, start + segment.size_bytes, region))
        if segment.staging is None:
            # A staged segment's mirror is only a source or sink of our own transfers: a
            # peer's one-sided write there would never reach the device, so no rkey is shown.
            segment.rdma_addr, segment.rdma_rkey = start, int(region.rkey)

    def _register_on_device(self, segment: Segment) -> bool:
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsError

        staging = segment.staging
        if staging is None or staging.device.type != "cuda":
            return False
        start = int(staging.device_bytes.data_ptr())
        try:
            region = MR(self._pd, segment.size_bytes, _access_flags(), address=start)
        except PyverbsError as error:  # no peer-memory support: the mirror it is
            log.info("rdma.gpu_memory_not_registered", segment=segment.name, error=str(error))
            return False
        self._regions.append((start, start + segment.size_bytes, region))
        self._on_device[segment.segment_id] = start
        segment.rdma_addr, segment.rdma_rkey = start, int(region.rkey)
        return True

    def moves_in_place(self, segment: Segment) -> bool:
        return segment.segment_id in self._on_device

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return peer.rdma is not None and all(info.rdma_rkey is not None for info in remote)

    async def write(self, plan: Plan) -> None:
        await self._post(plan, is_write=True)
        if plan.notifications:
            await self._tcp.notify(plan.peer, plan.notifications, plan.timeout_s)

    async def read(self, plan: Plan) -> None:
        await self._post(plan, is_write=False)

    async def _post(self, plan: Plan, *, is_write: bool) -> None:
        qp = await self._qp_to(plan.peer, plan.timeout_s)
        peer_id, key = plan.peer.engine_id, (plan.peer.engine_id, plan.peer.incarnation)
        try:
            async with asyncio.timeout(plan.timeout_s):
                for window in windows(plan.runs, _MAX_SEND_WR):
                    wr_id = next(self._wr_ids)
                    done = self._loop.create_future()
                    self._waiters[wr_id] = done
                    for request in build_work_requests(window, self._lkey, wr_id,
                                                       is_write=is_write,
                                                       on_device=self._on_device):
                        qp.post_send(request)
                    await done
        except TimeoutError:
            self._drop(key)
            raise TransferTimeout(f"RDMA transfer to {peer_id!r} did not complete within "
                                  f"{plan.timeout_s:g} s") from None
        except TransferFailed:
            self._drop(key)
            raise
        except Exception as error:  # pyverbs raises its own errors from post_send
            self._drop(key)
            raise TransferFailed(f"RDMA post to {peer_id!r} failed: {error}") from error

    def _lkey(self, address: int, length: int) -> int:
        for start, end, region in self._regions:
            if start <= address and address + length <= end:
                return int(region.lkey)
        raise TransferFailed("a local piece lies outside every RDMA-registered segment")

    async def _qp_to(self, peer: TransferEndpoint, timeout_s: float) -> Any:
        lock = self._connecting.setdefault(peer.engine_id, asyncio.Lock())
        async with lock:
            key = (peer.engine_id, peer.incarnation)
            qp = self._qps.get(key)
            if qp is None:
                for stale in [k for k in self._qps if k[0] == peer.engine_id]:
                    self._drop(stale)  # an earlier incarnation's
                qp, mine = self._new_qp()
                reply = await self._tcp.request(peer, wire.Op.RDMA_CONNECT, wire.encode(mine),
                                                timeout_s)
                self._bring_up(qp, mine, wire.decode(reply, wire.QpInfo))
                self._qps[key] = qp
            return qp

    def _accept(self, peer_id: str, remote: wire.QpInfo) -> wire.QpInfo:
        """A peer connects: give it a queue pair of ours to target."""
        qp, mine = self._new_qp()
        try:
            self._bring_up(qp, mine, remote)
        except Exception as error:
            qp.close()
            raise TransferFailed(f"cannot connect a queue pair to {peer_id!r}: {error}") \
                from error
        old = self._passive.pop(peer_id, None)
        if old is not None:
            old.close()
        self._passive[peer_id] = qp
        return mine

    def _new_qp(self) -> tuple[Any, wire.QpInfo]:
        from pyverbs.qp import QP

        qp = QP(self._pd, qp_init_attr(self._cq))
        info = wire.QpInfo(qp_num=int(qp.qp_num), psn=random.getrandbits(24),
                           lid=self.port.lid, gid=self.port.gid, mtu=self._mtu)
        return qp, info

    def _bring_up(self, qp: Any, mine: wire.QpInfo, remote: wire.QpInfo) -> None:
        qp.to_rts(qp_attr(self._port_num, self._gid_index, mine, remote))

    def _drop(self, key: tuple[str, str]) -> None:
        qp = self._qps.pop(key, None)
        if qp is not None:
            qp.close()

    def _poll_loop(self) -> None:
        """Completion polling, in its own thread: never on the event loop."""
        from pyverbs import enums

        idle = 0
        while not self._stopping.is_set():
            count, completions = self._cq.poll(16)
            if not count:
                idle += 1
                time.sleep(0 if idle < _SPIN_POLLS else 0.0001)
                continue
            idle = 0
            for completion in completions:
                done = self._waiters.pop(completion.wr_id, None)
                if done is not None:
                    is_ok = completion.status == enums.IBV_WC_SUCCESS
                    self._loop.call_soon_threadsafe(_settle, done, is_ok, completion.status)

    async def close(self) -> None:
        self._stopping.set()
        await asyncio.to_thread(self._poller.join, 5)
        for qp in [*self._qps.values(), *self._passive.values()]:
            qp.close()
        for _, _, region in self._regions:
            region.close()
        for resource in (self._cq, self._pd, self._ctx):
            resource.close()
        self._qps.clear()
        self._passive.clear()
        self._regions.clear()
        error = TransferFailed("transfer engine closed")
        for done in self._waiters.values():
            if not done.done():
                done.set_exception(error)


def _settle(done: asyncio.Future[None], is_ok: bool, status: int) -> None:
    if done.done():
        return
    if is_ok:
        done.set_result(None)
    else:
        done.set_exception(TransferFailed(f"RDMA work completion failed with status {status}"))


def windows(runs: list[Run], size: int) -> list[list[Run]]:
    """The runs cut into windows of at most `size` pieces (a send queue's depth)."""
    result: list[list[Run]] = [[]]
    room = size
    for run in runs:
        start = 0
        while start < run.num_pieces:
            if room == 0:
                result.append([])
                room = size
            stop = min(run.num_pieces, start + room)
            result[-1].append(run.take(start, stop))
            room -= stop - start
            start = stop
    return [window for window in result if window]


def build_work_requests(window: list[Run], lkey: Any, wr_id: int, *, is_write: bool,
                        on_device: dict[int, int] | None = None) -> list[Any]:
    """One RDMA WRITE (or READ) per piece; only the last is signaled and carries `wr_id`.
    A local segment in `on_device` (id -> device address) is addressed on its device."""
    from pyverbs import enums
    from pyverbs.wr import SGE, SendWR

    opcode = enums.IBV_WR_RDMA_WRITE if is_write else enums.IBV_WR_RDMA_READ
    requests = []
    for run in window:
        if run.remote.rdma_addr is None or run.remote.rdma_rkey is None:
            raise TransferFailed(f"segment {run.remote.name!r} is not an RDMA region")
        start = (on_device or {}).get(run.local.segment_id, run.local.address)
        key = lkey(start, run.local.size_bytes)
        local = (start + run.local_offsets).tolist()
        remote = (run.remote.rdma_addr + run.remote_offsets).tolist()
        for address, target, length in zip(local, remote, run.lengths.tolist(), strict=True):
            request = SendWR(wr_id=0, opcode=opcode, num_sge=1,
                             sg=[SGE(address, length, key)], send_flags=0)
            request.set_wr_rdma(run.remote.rdma_rkey, target)
            requests.append(request)
    requests[-1].wr_id = wr_id
    requests[-1].send_flags = enums.IBV_SEND_SIGNALED
    return requests


def qp_init_attr(cq: Any) -> Any:
    from pyverbs import enums
    from pyverbs.qp import QPCap, QPInitAttr

    cap = QPCap(max_send_wr=_MAX_SEND_WR, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    # sq_sig_all=0: only the last request of a window asks for a completion.
    return QPInitAttr(qp_type=enums.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def qp_attr(port_num: int, gid_index: int, mine: wire.QpInfo, remote: wire.QpInfo) -> Any:
    """Attributes for RESET -> INIT -> RTR -> RTS of an RC queue pair (RoCE-style global
    routing, so it also runs on Ethernet fabrics)."""
    from pyverbs import enums
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.qp import QPAttr

    attr = QPAttr(port_num=port_num)
    attr.qp_access_flags = _access_flags()
    attr.path_mtu = min(mine.mtu, remote.mtu) or enums.IBV_MTU_1024
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.sq_psn = mine.psn
    attr.max_dest_rd_atomic = 16
    attr.max_rd_atomic = 16
    attr.min_rnr_timer = 12
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    route = GlobalRoute(dgid=GID(remote.gid), sgid_index=gid_index)
    attr.ah_attr = AHAttr(gr=route, is_global=1, port_num=port_num, dlid=remote.lid)
    return attr


def _access_flags() -> int:
    from pyverbs import enums

    return (enums.IBV_ACCESS_LOCAL_WRITE | enums.IBV_ACCESS_REMOTE_WRITE
            | enums.IBV_ACCESS_REMOTE_READ)


def _text(name: bytes | str) -> str:
    return name.decode() if isinstance(name, bytes) else name
