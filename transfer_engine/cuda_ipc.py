"""The CUDA IPC transport: device memory to device memory between processes of one host,
with no host copy.

A CUDA tensor registered with the engine is exported once (`export_segment`): the driver
gives an IPC handle for the allocation holding it (the caching allocator may place the
tensor inside a larger allocation, so the handle comes with the tensor's offset in it) and
the device's UUID. Both travel in the segment's descriptor (`SegmentInfo.cuda_ipc`). A peer
on the same host that sees that device opens the handle once (`cuIpcOpenMemHandle`, peer
access enabled lazily for another GPU of the host), wraps the mapping as a uint8 tensor and
moves pieces with `copy_` on the current stream, then waits for them on an event before it
reports the transfer done; notifications follow over the TCP control connection, as for
shm, so they always come after their data. Reads copy the other way.

Ordering: the copies are queued on this process's current stream of the local device, after
whatever kernels already wrote the local pieces (the engine's KV writes of a layer, say), so
a layer handed over right after its compute is copied after it. The peer sees the bytes once
it has the notification (or, for a read, once `read` returned).

Not for: a peer whose GPUs this process cannot see (another container without the device, a
MIG slice), or a process that cannot open IPC handles; `can_reach` then says no or the open
fails as `TransferFailed`, and the engine goes on over the next transport (tcp, through the
pinned host mirror). Opening a handle in the process that exported it is not possible either
(CUDA refuses); engines of one process use the loopback or tcp transports.

Written against the CUDA driver API (libcuda, through ctypes) and torch's CUDA tensors; no
CUDA device was available where it was written, so only the bookkeeping around it (handles in
descriptors, piece arithmetic on CPU tensors) and the calls' marshaling (against a C stub of
the driver's signatures) have run: see the package README.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import sys
from typing import Any

import numpy as np
import structlog

from shared.messages import CudaIpcHandle, SegmentInfo, TransferEndpoint
from transfer_engine.errors import TransferFailed, TransferTimeout
from transfer_engine.segment import Segment
from transfer_engine.tcp import TcpTransport
from transfer_engine.transport import Plan

log = structlog.get_logger(__name__)

_LAZY_ENABLE_PEER_ACCESS = 0x1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # CUipcMemHandle


class _Uuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]  # CUuuid


class CudaDriver:
    """The few driver calls this transport needs; `CudaDriverError` (a `TransferFailed`) on
    any that fails."""

    def __init__(self, library: Any) -> None:
        self._lib = library
        self._lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    @classmethod
    def load(cls) -> CudaDriver:
        try:
            driver = cls(ctypes.CDLL("libcuda.so.1"))
        except OSError as error:
            raise TransferFailed(f"the CUDA driver library is not loadable: {error}") from error
        driver._call("cuInit", ctypes.c_uint(0))  # idempotent; torch may not have yet
        return driver

    def _call(self, name: str, *args: Any) -> None:
        function = getattr(self._lib, f"{name}_v2", None) or getattr(self._lib, name)
        result = function(*args)
        if result != 0:
            message = ctypes.c_char_p()
            self._lib.cuGetErrorString(result, ctypes.byref(message))
            text = message.value.decode() if message.value else "unknown error"
            raise TransferFailed(f"{name} failed: CUDA error {result} ({text})")

    def bind(self, ordinal: int) -> None:
        """Make the device's primary context (the one torch uses) current in this thread:
        the driver's memory calls need one, and the event loop's thread may never have
        made a CUDA call."""
        device, context = ctypes.c_int(), ctypes.c_void_p()
        self._call("cuDeviceGet", ctypes.byref(device), ctypes.c_int(ordinal))
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(context), device)
        self._call("cuCtxSetCurrent", context)

    def device_uuid(self, ordinal: int) -> str:
        device, uuid = ctypes.c_int(), _Uuid()
        self._call("cuDeviceGet", ctypes.byref(device), ctypes.c_int(ordinal))
        self._call("cuDeviceGetUuid", ctypes.byref(uuid), device)
        return bytes(uuid.bytes).hex()

    def allocation_base(self, pointer: int) -> int:
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call("cuMemGetAddressRange", ctypes.byref(base), ctypes.byref(size),
                   ctypes.c_uint64(pointer))
        return base.value

    def export(self, base: int) -> bytes:
        handle = _IpcMemHandle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), ctypes.c_uint64(base))
        # The whole 64 bytes: the field itself reads as a C string, cut at the first zero.
        return bytes(handle)

    def open(self, handle: bytes) -> int:
        pointer = ctypes.c_uint64()
        raw = _IpcMemHandle.from_buffer_copy(handle)  # assigning the field stops at a zero
        self._call("cuIpcOpenMemHandle", ctypes.byref(pointer), raw,
                   ctypes.c_uint(_LAZY_ENABLE_PEER_ACCESS))
        return pointer.value

    def close(self, pointer: int) -> None:
        self._call("cuIpcCloseMemHandle", ctypes.c_uint64(pointer))


class _DeviceBytes:
    """A device address range as the CUDA array interface describes it, for `torch.as_tensor`
    (which then aliases the memory: no copy)."""

    def __init__(self, pointer: int, size_bytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size_bytes,), "typestr": "|u1",
                                         "data": (pointer, False), "version": 2}


def export_segment(driver: CudaDriver, tensor: Any) -> CudaIpcHandle:
    """The descriptor of a contiguous CUDA tensor that a peer process opens."""
    pointer = tensor.data_ptr()
    driver.bind(tensor.device.index)
    base = driver.allocation_base(pointer)
    return CudaIpcHandle(device_uuid=driver.device_uuid(tensor.device.index),
                         handle=driver.export(base).hex(), offset_bytes=pointer - base)


def copy_pieces(target: Any, source: Any, target_offsets: np.ndarray,
                source_offsets: np.ndarray, lengths: np.ndarray) -> None:
    """Queue one copy per piece between two flat uint8 tensors (any devices)."""
    for to, start, length in zip(target_offsets.tolist(), source_offsets.tolist(),
                                 lengths.tolist(), strict=True):
        target[to:to + length].copy_(source[start:start + length], non_blocking=True)


class CudaIpcTransport:
    name = "cuda"
    is_one_sided = True

    def __init__(self, host_id: str, tcp: TcpTransport, driver: CudaDriver,
                 device_uuids: dict[str, int]) -> None:
        self._host_id = host_id
        self._tcp = tcp
        self._driver = driver
        self._devices = device_uuids  # UUID -> this process's ordinal, for visible GPUs
        # (peer, segment id) -> (its handle, our mapping's base, the segment as a tensor)
        self._opened: dict[tuple[str, int], tuple[CudaIpcHandle, int, Any]] = {}

    def register_memory(self, segment: Segment) -> None:
        """Export a CUDA segment, so that its descriptor carries the IPC handle."""
        staging = segment.staging
        if staging is None or staging.device.type != "cuda":
            return
        try:
            segment.cuda_ipc = export_segment(self._driver, staging.device_bytes)
        except TransferFailed as error:  # e.g. memory from expandable segments: no IPC handle
            log.warning("transfer.cuda_ipc_unavailable", segment=segment.name, error=str(error))

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return peer.host_id == self._host_id and all(
            info.cuda_ipc is not None and info.cuda_ipc.device_uuid in self._devices
            for info in remote)

    async def write(self, plan: Plan) -> None:
        await self._copy(plan, is_write=True)
        if plan.notifications:
            await self._tcp.notify(plan.peer, plan.notifications, plan.timeout_s)

    async def read(self, plan: Plan) -> None:
        await self._copy(plan, is_write=False)

    async def _copy(self, plan: Plan, *, is_write: bool) -> None:
        import torch

        devices = set()
        for run in plan.runs:
            local, remote = _local_bytes(run.local), self._open(plan.peer, run.remote)
            try:
                if is_write:
                    copy_pieces(remote, local, run.remote_offsets, run.local_offsets,
                                run.lengths)
                else:
                    copy_pieces(local, remote, run.local_offsets, run.remote_offsets,
                                run.lengths)
            except RuntimeError as error:  # a CUDA error: the context may be unusable
                raise TransferFailed(f"device copy with {plan.peer.engine_id!r} failed: "
                                     f"{error}") from error
            # A copy between two GPUs runs on the source's stream and the target's stream
            # waits for it; a host piece's copy on the device's: an event on the current
            # stream of the device that is ours (or the only one) follows every copy.
            devices.add(local.device if local.is_cuda else remote.device)
        events = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        try:
            await asyncio.wait_for(asyncio.to_thread(_wait_all, events), plan.timeout_s)
        except TimeoutError as error:
            raise TransferTimeout(f"copies with {plan.peer.engine_id!r} did not finish within "
                                  f"{plan.timeout_s}s") from error

    def _open(self, peer: TransferEndpoint, info: SegmentInfo) -> Any:
        """The peer's segment as a uint8 tensor here (opened once per segment and handle: a
        peer restarted under the same id publishes new handles, and the old mapping goes)."""
        key = (peer.engine_id, info.segment_id)
        handle = info.cuda_ipc
        opened = self._opened.get(key)
        if opened is not None and opened[0] == handle:
            return opened[2]
        if opened is not None:
            self._close(opened[1])
            del self._opened[key]
        if handle is None or handle.device_uuid not in self._devices:
            raise TransferFailed(f"{peer.engine_id!r}'s segment {info.name!r} is not in device "
                                 "memory this process can see")
        import torch

        ordinal = self._devices[handle.device_uuid]
        self._driver.bind(ordinal)  # open where the memory is
        base = self._driver.open(bytes.fromhex(handle.handle))
        pointer = base + handle.offset_bytes
        # The device named: without it, older torch builds copy the array to the CPU.
        tensor = torch.as_tensor(_DeviceBytes(pointer, info.size_bytes),
                                 device=torch.device("cuda", ordinal))
        if tensor.data_ptr() != pointer:  # a copy instead of a view would lose writes
            self._close(base)
            raise TransferFailed(f"{peer.engine_id!r}'s segment {info.name!r} could not be "
                                 "mapped in place")
        self._opened[key] = (handle, base, tensor)
        return tensor

    def _close(self, base: int) -> None:
        with contextlib.suppress(TransferFailed):  # the peer already gone: nothing held
            self._driver.close(base)

    def moves_in_place(self, segment: Segment) -> bool:
        return segment.staging is not None  # copies from and to the tensor itself

    async def close(self) -> None:
        for _, base, _ in self._opened.values():
            self._close(base)
        self._opened.clear()


def _wait_all(events: list[Any]) -> None:
    for event in events:
        event.synchronize()


def _local_bytes(segment: Segment) -> Any:
    import torch

    if segment.staging is not None:
        return segment.staging.device_bytes
    return torch.frombuffer(segment.data, dtype=torch.uint8)


def open_transport(host_id: str, tcp: TcpTransport) -> CudaIpcTransport | None:
    """The transport, or None where it cannot run: torch not in use by this process (a worker
    without a device pool never imports it for this), no CUDA device, or no driver."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    try:
        driver = CudaDriver.load()
        devices = {driver.device_uuid(i): i for i in range(torch.cuda.device_count())}
    except TransferFailed:
        return None
    return CudaIpcTransport(host_id, tcp, driver, devices)
