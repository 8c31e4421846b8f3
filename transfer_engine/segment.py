"""Registered memory: local segments, their byte views, and POSIX shared memory regions.

A segment is a flat byte range that peers address by `(segment_id, offset, length)`. Any
writable buffer can be registered (bytearray, numpy array, CPU torch tensor); memory made by
`SharedMemoryRegion` can in addition be mapped by a same-host peer, which is what makes the
shm transport one-sided. Invariant: every range is checked with `check_bounds` (by the engine
for its own batches, by `LocalMemory.views` for a peer's) before a byte moves.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.child_process import is_alive
from shared.messages import CudaIpcHandle, SegmentInfo
from transfer_engine.errors import InvalidTransfer
from transfer_engine.staging import DeviceStaging

SHM_DIR = Path("/dev/shm")


def as_byte_view(buffer: Any) -> memoryview:
    """A flat byte view of `buffer` without copying it. Torch tensors must be contiguous and on
    the CPU (device tensors are registered through a host mirror: see staging.py)."""
    if _is_torch_tensor(buffer):
        return _tensor_bytes(buffer)
    try:
        view = memoryview(buffer)
    except TypeError as error:
        raise InvalidTransfer(f"cannot register {type(buffer).__name__}: "
                              "not a buffer, numpy array or torch tensor") from error
    if not view.c_contiguous:
        raise InvalidTransfer("cannot register a non-contiguous buffer")
    return view.cast("B")


def buffer_address(view: memoryview) -> int:
    """The address of a C-contiguous, non-empty byte view's first byte."""
    if view.readonly:  # ctypes maps only writable buffers; numpy takes either
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def is_device_tensor(buffer: Any) -> bool:
    return _is_torch_tensor(buffer) and buffer.device.type != "cpu"


def _is_torch_tensor(buffer: Any) -> bool:
    return type(buffer).__module__.startswith("torch") and hasattr(buffer, "data_ptr")


def _tensor_bytes(tensor: Any) -> memoryview:
    if tensor.device.type != "cpu":
        raise InvalidTransfer(f"cannot register a {tensor.device.type} tensor: only CPU "
                              "memory is host-addressable by the shm, tcp and rdma transports")
    if not tensor.is_contiguous():
        raise InvalidTransfer("cannot register a non-contiguous tensor")
    import torch  # only reached when the caller already uses torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


@dataclass(eq=False)
class Segment:
    """A registered local region. `owner` keeps the registered object alive."""

    name: str
    segment_id: int
    data: memoryview
    owner: Any = None
    shm_name: str | None = None
    rdma_addr: int | None = None
    rdma_rkey: int | None = None
    staging: DeviceStaging | None = None  # device memory behind a host mirror (`data`)
    mirror_shm_name: str | None = None  # that mirror's shared memory, when it is shared
    cuda_ipc: CudaIpcHandle | None = None  # set by the cuda transport for GPU memory
    _address: int | None = field(default=None, repr=False)

    @property
    def size_bytes(self) -> int:
        return self.data.nbytes

    @property
    def address(self) -> int:
        """Where the segment's first byte is in this process (for memmove and RDMA)."""
        if self._address is None:
            self._address = buffer_address(self.data)
        return self._address

    @property
    def is_writable(self) -> bool:
        return not self.data.readonly

    def info(self) -> SegmentInfo:
        return SegmentInfo(name=self.name, segment_id=self.segment_id,
                           size_bytes=self.size_bytes, shm_name=self.shm_name,
                           rdma_addr=self.rdma_addr, rdma_rkey=self.rdma_rkey,
                           cuda_ipc=self.cuda_ipc, mirror_shm_name=self.mirror_shm_name)


def check_bounds(name: str, size_bytes: int, offset: int, length: int) -> None:
    if not 0 <= offset <= offset + length <= size_bytes:
        raise InvalidTransfer(f"piece [{offset}, {offset + length}) is outside segment "
                              f"{name!r} of {size_bytes} bytes")


class SharedMemoryRegion:
    """A POSIX shared-memory object mapped into this process (created or attached by name).

    Mapped with MAP_POPULATE so the first transfer does not pay a page fault per page. The
    creator unlinks the name in `close()`; an attacher only unmaps. Names carry the creator's
    pid so `sweep_orphans` can remove what a killed process left behind.
    """

    def __init__(self, name: str, size_bytes: int, *, create: bool) -> None:
        self.name = name
        self.size_bytes = size_bytes
        self.is_owner = create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:  # reserved now: a full /dev/shm fails here, not with SIGBUS on use
                os.posix_fallocate(fd, 0, size_bytes)
            elif os.fstat(fd).st_size < size_bytes:
                # Mapping past the end of the object would SIGBUS on first touch.
                raise InvalidTransfer(f"shared memory {name!r} is smaller than its descriptor "
                                      f"says ({os.fstat(fd).st_size} < {size_bytes} bytes)")
            self._mmap = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            if create:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.buffer = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (if no view of it is still exported) and, for the creator, unlink the name."""
        # A caller may still hold a numpy array or tensor over the mapping; then the kernel
        # unmaps it when the last such object dies. The name is removed regardless.
        with contextlib.suppress(BufferError):
            self.buffer.release()
            self._mmap.close()
        if self.is_owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.is_owner = False


def shm_name_for(engine_id: str, number: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:40]
    return f"halfmoon-te-{os.getpid()}-{safe}-{number}"


def sweep_orphans() -> list[str]:
    """Unlink shared-memory names left by transfer engines whose process is gone."""
    removed = []
    for path in SHM_DIR.glob("halfmoon-te-*"):
        pid_text = path.name.split("-")[2]
        if pid_text.isdigit() and not is_alive(int(pid_text)):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
