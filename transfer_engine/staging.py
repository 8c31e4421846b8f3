"""Device memory (CUDA tensors) registered through a pinned host mirror.

The transports move host bytes, so a device tensor is registered as a host mirror of the
same size plus this staging object. The engine copies the pieces a transfer touches between
device and mirror: before it sends them (device to host), after bytes land in them (host to
device), and before it serves a peer's read. Peers reach such a segment over tcp, which
lands bytes through the owner; and, when the mirror is in shared memory (where /dev/shm has
room for it), over shm from the same host, the writer naming the pieces it copied to the
owner over tcp (and a reader the pieces it is about to copy), so the owner moves them between
mirror and device: where CUDA IPC cannot be used (another container, a GPU this process does
not see), same-host peers still skip the socket. Not rdma into the mirror, which would write
it without the owner noticing. Two paths skip the mirror: the cuda transport (cuda_ipc.py)
copies device to device for same-host peers that see the GPU, and the rdma transport
registers the device memory itself where the NIC can (GPUDirect RDMA).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np


class DeviceStaging:
    """A device tensor's bytes and its host mirror: a pinned buffer of its own, or `mirror`
    (shared memory, page-locked for the device's copies where CUDA allows it)."""

    def __init__(self, tensor: Any, mirror: memoryview | None = None) -> None:
        import torch

        self.device = tensor.device
        self._device_bytes = tensor.reshape(-1).view(torch.uint8)
        self._is_host_registered = False
        if mirror is None:
            self._mirror = torch.empty(self._device_bytes.numel(), dtype=torch.uint8,
                                       pin_memory=tensor.device.type == "cuda")
        else:
            self._mirror = torch.frombuffer(mirror, dtype=torch.uint8)
            if tensor.device.type == "cuda":  # else its copies go through pageable memory
                self._is_host_registered = int(torch.cuda.cudart().cudaHostRegister(
                    self._mirror.data_ptr(), self._mirror.numel(), 0)) == 0  # a pybind enum
        self.host = memoryview(self._mirror.numpy())
        # The copies' own stream: on the default stream they would queue behind the compute
        # already issued and hold back the compute issued after them (layer-wise KV: the
        # next layers), and waiting for them would take a device-wide synchronize.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def close(self) -> None:
        """Unpin a shared mirror (before it is unmapped)."""
        if self._is_host_registered:
            import torch

            with contextlib.suppress(RuntimeError):
                torch.cuda.cudart().cudaHostUnregister(self._mirror.data_ptr())
            self._is_host_registered = False

    @property
    def device_bytes(self) -> Any:
        """The registered tensor itself, as flat bytes (a uint8 view, no copy)."""
        return self._device_bytes

    def to_host(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Device to mirror, for the pieces about to be sent."""
        self._copy(self._mirror, self._device_bytes, offsets, lengths)

    def to_device(self, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Mirror to device, for the pieces that just landed."""
        self._copy(self._device_bytes, self._mirror, offsets, lengths)

    def _copy(self, target: Any, source: Any, offsets: np.ndarray, lengths: np.ndarray) -> None:
        """Copy the pieces and return once they are copied. On CUDA: after the work issued
        so far on the caller's stream (what wrote the pieces, or reads them), on the copies'
        stream, waiting for those copies alone."""
        pieces = zip(offsets.tolist(), lengths.tolist(), strict=True)
        if self._stream is None:
            for offset, length in pieces:
                target[offset:offset + length].copy_(source[offset:offset + length])
            return
        import torch

        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for offset, length in pieces:
                target[offset:offset + length].copy_(source[offset:offset + length],
                                                     non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        copied.synchronize()
