"""The RDMA transport where it can be checked without a device: detection, and the work
requests and queue-pair attributes built with the real pyverbs classes (Debian's
python3-pyverbs). Transfers over a device run in the conformance suite, where one exists."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shared.messages import SegmentInfo
from tests.transfer.conftest import SECRET
from transfer_engine import wire
from transfer_engine.batch import Run
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.rdma import (
    build_work_requests,
    detect_devices,
    qp_attr,
    qp_init_attr,
    windows,
)
from transfer_engine.segment import Segment

_DEBIAN_DIST = Path("/usr/lib/python3/dist-packages")


@pytest.fixture
def pyverbs() -> Iterator[object]:
    """pyverbs from the venv, or else from Debian's package (it does not build from PyPI
    against Debian's rdma-core)."""
    added = False
    try:
        import pyverbs
    except ImportError:
        if not (_DEBIAN_DIST / "pyverbs").is_dir():
            pytest.skip("pyverbs is not installed (apt install python3-pyverbs)")
        sys.path.append(str(_DEBIAN_DIST))
        added = True
    try:
        import pyverbs.enums
    except ImportError as error:
        pytest.skip(f"pyverbs does not import here: {error}")
    yield pyverbs.enums
    if added:
        sys.path.remove(str(_DEBIAN_DIST))


async def test_an_engine_without_a_device_falls_back_to_tcp() -> None:
    engine = TransferEngine(TransferConfig(engine_id="rdma-less", secret=SECRET,
                                           transports=("rdma", "tcp")))
    await engine.start()
    try:
        expected = ["rdma", "tcp"] if detect_devices() else ["tcp"]
        assert engine.transport_names == expected
        assert (engine.endpoint().rdma is not None) == bool(detect_devices())
    finally:
        await engine.close()


def test_device_detection_does_not_raise_without_devices(pyverbs: object) -> None:
    # get_device_list() raises when there is no device; detection must say "none" instead.
    assert isinstance(detect_devices(), list)


def remote(name: str = "kv") -> SegmentInfo:
    return SegmentInfo(name=name, segment_id=1, size_bytes=1 << 20, rdma_addr=0x7000_0000,
                       rdma_rkey=0x42)


def test_a_window_is_one_request_per_piece_and_only_the_last_is_signaled(
        pyverbs: object) -> None:
    enums = pyverbs
    local = Segment(name="kv", segment_id=1, data=memoryview(bytearray(8192)))
    run = Run(local, remote(), np.array([0, 4096]), np.array([0, 65536]), np.array([4096, 4096]))
    keys = []
    requests = build_work_requests([run], lambda addr, n: keys.append((addr, n)) or 7, 99,
                                   is_write=True)
    assert [r.opcode for r in requests] == [enums.IBV_WR_RDMA_WRITE] * 2
    assert [r.wr_id for r in requests] == [0, 99]
    assert [r.send_flags for r in requests] == [0, enums.IBV_SEND_SIGNALED]
    assert [r.num_sge for r in requests] == [1, 1]
    assert keys == [(local.address, 8192)]  # the local key of the segment's region


def test_a_segment_registered_on_its_device_is_addressed_there(pyverbs: object) -> None:
    """GPUDirect RDMA: a device segment's pieces are read where the NIC registered them,
    not from its host mirror."""
    local = Segment(name="kv", segment_id=3, data=memoryview(bytearray(8192)))
    run = Run(local, remote(), np.array([0]), np.array([0]), np.array([4096]))
    keys = []
    build_work_requests([run], lambda addr, n: keys.append((addr, n)) or 7, 1, is_write=True,
                        on_device={3: 0x7F00_0000_0000})
    assert keys == [(0x7F00_0000_0000, 8192)]


def test_a_batch_is_posted_in_windows_of_the_send_queue_depth() -> None:
    local = Segment(name="kv", segment_id=1, data=memoryview(bytearray(8192)))
    run = Run(local, remote(), np.arange(5), np.arange(5) * 2, np.ones(5, dtype=np.int64))
    parts = windows([run, run], 4)
    assert [sum(r.num_pieces for r in window) for window in parts] == [4, 4, 2]
    assert parts[1][0].local_offsets.tolist() == [4]


def test_reads_use_rdma_read(pyverbs: object) -> None:
    enums = pyverbs
    local = Segment(name="kv", segment_id=1, data=memoryview(bytearray(64)))
    run = Run(local, remote(), np.array([0]), np.array([8]), np.array([64]))
    (request,) = build_work_requests([run], lambda a, n: 1, 5,
                                     is_write=False)
    assert request.opcode == enums.IBV_WR_RDMA_READ


def test_queue_pair_attributes_target_the_peer(pyverbs: object) -> None:
    enums = pyverbs
    mine = wire.QpInfo(qp_num=11, psn=100, lid=1, gid="fe80::1", mtu=enums.IBV_MTU_4096)
    theirs = wire.QpInfo(qp_num=22, psn=200, lid=2,
                         gid="fe80:0000:0000:0000:9a03:9bff:fe00:e4bf", mtu=enums.IBV_MTU_1024)
    attr = qp_attr(1, 0, mine, theirs)
    assert (attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (22, 200, 100)
    assert attr.path_mtu == enums.IBV_MTU_1024  # the smaller of the two
    assert attr.qp_access_flags & enums.IBV_ACCESS_REMOTE_WRITE
    assert attr.qp_access_flags & enums.IBV_ACCESS_REMOTE_READ
    init = qp_init_attr(None)
    assert (init.qp_type, init.sq_sig_all) == (enums.IBV_QPT_RC, 0)
