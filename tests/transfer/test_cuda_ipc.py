"""The cuda transport: its bookkeeping everywhere (handles in descriptors, which peers it
reaches, where pieces land, no mirror copies when it carries a staged segment), and device
to device between two processes where a CUDA device exists (`gpu`)."""

from __future__ import annotations

import asyncio
import ctypes
import shutil
import subprocess
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.messages import CudaIpcHandle, SegmentInfo, TransferEndpoint
from tests.transfer.conftest import Pair, start_pair
from transfer_engine.cuda_ipc import (
    CudaDriver,
    CudaIpcTransport,
    copy_pieces,
    export_segment,
    open_transport,
)
from transfer_engine.errors import TransferFailed
from transfer_engine.segment import Segment
from transfer_engine.transport import Plan

UUID = "5f0e3c8a9b1d4e2f8a7b6c5d4e3f2a1b"
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                           reason="no CUDA device here: the cuda transport's "
                                                  "device copies are untested on this machine")]


class FakeDriver:
    """`CudaDriver`'s calls, answered from fixed values (no libcuda here)."""

    def bind(self, ordinal: int | None) -> None:
        return None

    def allocation_base(self, pointer: int) -> int:
        return pointer - 3 * 4096

    def device_uuid(self, ordinal: int | None) -> str:
        return UUID

    def export(self, base: int) -> bytes:
        return bytes(range(64))


@pytest.fixture(scope="module")
def stub_driver(tmp_path_factory: pytest.TempPathFactory) -> CudaDriver:
    """`CudaDriver` over `cuda_driver_stub.c`, built here: the driver API's signatures, so
    the real calls' ctypes marshaling runs without libcuda."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the driver stub with")
    library = tmp_path_factory.mktemp("cuda") / "libcuda_stub.so"
    source = Path(__file__).with_name("cuda_driver_stub.c")
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)],
                   check=True)
    return CudaDriver(ctypes.CDLL(str(library)))


def test_an_ipc_handle_crosses_the_driver_calls_whole(stub_driver: CudaDriver) -> None:
    """A handle holds zero bytes (its first one here): exported and opened again, all 64
    bytes must pass, or the peer's open fails (a ctypes char array reads and writes as a
    C string, cut at the first zero)."""
    base = stub_driver.allocation_base(0x7F00_0012_3456)
    assert base == 0x7F00_0010_0000
    handle = stub_driver.export(base)
    assert len(handle) == 64 and handle[0] == 0 and any(handle[1:])
    pointer = stub_driver.open(handle)
    assert pointer == 0x7E00_0000_0000
    stub_driver.close(pointer)
    stub_driver.bind(1)
    assert stub_driver.device_uuid(1) == bytes(range(16, 32)).hex()


def test_a_failed_driver_call_is_a_transfer_failure_in_the_driver_s_words(
        stub_driver: CudaDriver) -> None:
    with pytest.raises(TransferFailed, match=r"cuIpcOpenMemHandle failed: CUDA error 400 "
                                             r"\(invalid resource handle\)"):
        stub_driver.open(bytes(range(64)))  # not a handle this driver gave


def endpoint(host_id: str, *segments: SegmentInfo) -> TransferEndpoint:
    return TransferEndpoint(engine_id="decode-0", host_id=host_id, tcp_host="127.0.0.1",
                            tcp_port=1, segments=list(segments))


def gpu_segment(uuid: str = UUID) -> SegmentInfo:
    return SegmentInfo(name="kv", segment_id=1, size_bytes=4096,
                       cuda_ipc=CudaIpcHandle(device_uuid=uuid, handle="00" * 64))


def test_an_exported_segment_names_its_device_handle_and_offset_in_the_allocation() -> None:
    tensor = torch.zeros(64, dtype=torch.uint8)
    handle = export_segment(FakeDriver(), tensor)  # type: ignore[arg-type]
    assert handle == CudaIpcHandle(device_uuid=UUID, handle=bytes(range(64)).hex(),
                                   offset_bytes=3 * 4096)


def test_it_reaches_gpu_segments_of_a_same_host_peer_whose_device_it_sees() -> None:
    transport = CudaIpcTransport("host-a", None, FakeDriver(), {UUID: 0})  # type: ignore[arg-type]
    assert transport.can_reach(endpoint("host-a"), [gpu_segment()])
    assert not transport.can_reach(endpoint("host-b"), [gpu_segment()])  # another host
    assert not transport.can_reach(endpoint("host-a"), [gpu_segment("0" * 32)])  # unseen GPU
    host_segment = SegmentInfo(name="kv", segment_id=1, size_bytes=4096, shm_name="x")
    assert not transport.can_reach(endpoint("host-a"), [gpu_segment(), host_segment])


def test_each_piece_lands_where_the_plan_names_it() -> None:
    source = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    target = torch.zeros(256, dtype=torch.uint8)
    copy_pieces(target, source, np.array([200, 0]), np.array([10, 100]), np.array([8, 50]))
    assert torch.equal(target[200:208], source[10:18])
    assert torch.equal(target[:50], source[100:150])
    assert int(target[50:200].count_nonzero()) == 0 and int(target[208:].count_nonzero()) == 0


def test_there_is_no_cuda_transport_without_a_cuda_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert open_transport("host-a", None) is None  # type: ignore[arg-type]


class InPlaceTransport:
    """Implements `Transport` as a device-to-device one does (`moves_in_place`): it
    notes what the staged source's mirror held when it ran, then fails."""

    name = "in-place"
    is_one_sided = True

    def __init__(self) -> None:
        self.mirrors_seen: list[bytes] = []

    def can_reach(self, peer: TransferEndpoint, remote: list[SegmentInfo]) -> bool:
        return True

    async def write(self, plan: Plan) -> None:
        self.mirrors_seen += [bytes(run.local.data[:16]) for run in plan.runs]
        raise TransferFailed("simulated: the peer's IPC handle cannot be opened")

    async def read(self, plan: Plan) -> None:
        await self.write(plan)

    def moves_in_place(self, segment: Segment) -> bool:
        return True

    async def close(self) -> None:
        return None


@pytest.fixture
async def tcp_pair() -> AsyncIterator[Pair]:
    running = await start_pair("tcp")
    yield running
    await running.source.close()
    await running.target.close()


async def test_a_device_transport_takes_staged_bytes_in_place_and_tcp_after_it_the_mirror(
        tcp_pair: Pair) -> None:
    source = torch.arange(1, 1025, dtype=torch.float32)
    target = torch.zeros(1024, dtype=torch.float32)
    await tcp_pair.source.register("dev-src", source, is_staged=True)
    await tcp_pair.target.register("dev-dst", target, is_staged=True)
    in_place = InPlaceTransport()
    tcp_pair.source._transports.insert(0, in_place)
    result = await tcp_pair.source.write(tcp_pair.target.config.engine_id,
                                         [("dev-src", 0, "dev-dst", 0, 4096)])
    first_bytes = source[:4].numpy().tobytes()
    assert len(in_place.mirrors_seen) == 1
    assert in_place.mirrors_seen[0] != first_bytes  # not copied to the mirror for it
    assert result.transport == "tcp"
    assert torch.equal(target, source)  # the fallback filled the mirror first


CHILD = """
import asyncio, hashlib, sys, torch
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine

async def main():
    engine = TransferEngine(TransferConfig(engine_id="ipc-child", secret=b"gpu-test",
                                           transports=("cuda", "tcp")))
    await engine.start()
    kv = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    await engine.register("kv", kv)
    print(engine.endpoint().tcp_port, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        offset, length = map(int, line.split())
        torch.cuda.synchronize()
        print(hashlib.sha256(kv[offset:offset + length].cpu().numpy().tobytes()).hexdigest(),
              flush=True)
    await engine.close()

asyncio.run(main())
"""


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=GPU)])
async def test_device_bytes_move_between_processes_over_cuda_ipc(device: str) -> None:
    import hashlib

    from transfer_engine.config import TransferConfig
    from transfer_engine.engine import TransferEngine

    child = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD,
                                                 stdin=PIPE, stdout=PIPE)
    assert child.stdout is not None and child.stdin is not None
    engine = TransferEngine(TransferConfig(engine_id="ipc-parent", secret=b"gpu-test",
                                           transports=("cuda", "tcp")))

    async def child_sha(offset: int, length: int) -> str:
        child.stdin.write(f"{offset} {length}\n".encode())  # type: ignore[union-attr]
        return (await child.stdout.readline()).decode().strip()  # type: ignore[union-attr]

    try:
        port = int(await child.stdout.readline())
        await engine.start()
        source = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=device)
        await engine.register("kv", source)
        peer = await engine.connect("127.0.0.1", port)
        assert peer.segments[0].cuda_ipc is not None
        written = await engine.write(peer, [("kv", 4096, "kv", 65536, 300_000)])
        assert written.transport == "cuda"
        expected = hashlib.sha256(source[4096:304096].cpu().numpy().tobytes()).hexdigest()
        assert await child_sha(65536, 300_000) == expected
        source.zero_()
        read = await engine.read(peer, [("kv", 0, "kv", 65536, 300_000)])
        assert read.transport == "cuda"
        assert hashlib.sha256(source[:300_000].cpu().numpy().tobytes()).hexdigest() == expected
    finally:
        await engine.close()
        child.stdin.close()
        await asyncio.wait_for(child.wait(), 30)
