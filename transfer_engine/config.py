"""A transfer engine's settings: plain data, imported by the engine and every transport
(so none of them needs the engine's module to name its config)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path


def default_host_id() -> str:
    """Same value on every process of one machine (and kernel boot), different elsewhere."""
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    suffix = boot_id.read_text().strip() if boot_id.exists() else ""
    return f"{socket.gethostname()}/{suffix}"


@dataclass(frozen=True)
class TcpOptions:
    num_streams: int = 2  # connections a large batch is striped over
    stripe_min_bytes: int = 8 << 20
    connect_timeout_s: float = 5.0
    frame_timeout_s: float = 30.0


@dataclass(frozen=True)
class TransferConfig:
    engine_id: str
    secret: bytes
    host_id: str = field(default_factory=default_host_id)
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    advertise_host: str | None = None  # what peers dial; defaults to listen_host
    transports: tuple[str, ...] = ("cuda", "rdma", "shm", "tcp")  # preference order
    timeout_s: float = 30.0
    rdma_device: str | None = None  # default: the first device found
    rdma_port_num: int = 1
    rdma_gid_index: int = 0
    tcp: TcpOptions = field(default_factory=TcpOptions)
