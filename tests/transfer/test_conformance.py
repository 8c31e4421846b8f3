"""One suite, every transport: what any transport must do for the engine's callers."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from typing import Any

import numpy as np
import pytest
import torch

from tests.transfer.conftest import SEGMENT_BYTES, Pair, start_pair
from transfer_engine import compression
from transfer_engine import memory as memory_module
from transfer_engine.batch import Run
from transfer_engine.errors import InvalidTransfer, PeerNotFound, TransferFailed
from transfer_engine.staging import DeviceStaging


def fill(view: memoryview, seed: int) -> None:
    view[:] = random.Random(seed).randbytes(view.nbytes)


async def test_write_lands_the_bytes_and_reports_the_transport(pair: Pair) -> None:
    fill(pair.source_kv, 1)
    result = await pair.source.write("target-" + pair.transport,
                                     [("kv", 4096, "kv", 65536, 100_000)])
    assert pair.target_kv[65536:165536] == pair.source_kv[4096:104096]
    assert pair.target_kv[:65536] == bytes(65536)  # nothing outside the piece changed
    assert (result.transport, result.num_bytes, result.num_pieces) == (
        pair.transport, 100_000, 1)
    assert result.seconds > 0


async def test_read_fetches_the_peers_bytes(pair: Pair) -> None:
    fill(pair.target_kv, 2)
    result = await pair.source.read(pair.target.config.engine_id,
                                    [("kv", 0, "kv", 12345, 5000), ("kv", 9000, "kv", 0, 77)])
    assert pair.source_kv[:5000] == pair.target_kv[12345:17345]
    assert pair.source_kv[9000:9077] == pair.target_kv[:77]
    assert result.transport == pair.transport


async def test_notification_arrives_after_its_data(pair: Pair) -> None:
    fill(pair.source_kv, 3)
    await pair.source.write(pair.target.config.engine_id, [("kv", 0, "kv", 0, SEGMENT_BYTES)],
                            notify=b"request r1 layer 3")
    note = await asyncio.wait_for(pair.target.notifications.get(), 5)
    assert note.payload == b"request r1 layer 3"
    assert note.peer_id == pair.source.config.engine_id
    assert pair.target_kv == pair.source_kv  # already landed when the note is read


async def test_contiguous_pieces_are_coalesced(pair: Pair) -> None:
    fill(pair.source_kv, 4)
    batch = [("kv", i * 4096, "kv", i * 4096, 4096) for i in range(16)]
    result = await pair.source.write(pair.target.config.engine_id, batch)
    assert result.num_pieces == 1
    assert pair.target_kv[:65536] == pair.source_kv[:65536]


async def test_scattered_pieces_each_land_where_named(pair: Pair) -> None:
    fill(pair.source_kv, 5)
    rng = random.Random(5)
    slots = rng.sample(range(0, SEGMENT_BYTES // 4096, 2), 100)  # never adjacent
    batch = [("kv", i * 4096, "kv", slot * 4096, 4096) for i, slot in enumerate(slots)]
    result = await pair.source.write(pair.target.config.engine_id, batch)
    assert result.num_pieces == 100
    for i, slot in enumerate(slots):
        assert pair.target_kv[slot * 4096:(slot + 1) * 4096] == \
            pair.source_kv[i * 4096:(i + 1) * 4096]


async def test_many_concurrent_batches_all_land(pair: Pair) -> None:
    fill(pair.source_kv, 6)
    size = SEGMENT_BYTES // 64
    writes = [pair.source.write(pair.target.config.engine_id,
                                [("kv", i * size, "kv", (63 - i) * size, size)],
                                notify=str(i).encode())
              for i in range(64)]
    results = await asyncio.gather(*writes)
    assert sum(result.num_bytes for result in results) == SEGMENT_BYTES
    for i in range(64):
        assert pair.target_kv[(63 - i) * size:(64 - i) * size] == \
            pair.source_kv[i * size:(i + 1) * size]
    notes = {pair.target.notifications.get_nowait().payload for _ in range(64)}
    assert notes == {str(i).encode() for i in range(64)}


async def test_random_offsets_and_lengths(pair: Pair) -> None:
    rng = random.Random(7)
    fill(pair.source_kv, 7)
    for _ in range(30):
        length = rng.randint(1, 70_000)
        local, remote = rng.randint(0, SEGMENT_BYTES - length), rng.randint(
            0, SEGMENT_BYTES - length)
        await pair.source.write(pair.target.config.engine_id,
                                [("kv", local, "kv", remote, length)])
        assert pair.target_kv[remote:remote + length] == pair.source_kv[local:local + length]


async def test_torch_and_numpy_buffers_can_be_registered(pair: Pair) -> None:
    tensor = torch.arange(1024, dtype=torch.bfloat16)
    array = np.zeros(1024, dtype=np.float32)
    await pair.source.register("tensor", tensor)
    await pair.target.register("array", array)
    await pair.source.write(pair.target.config.engine_id, [("tensor", 0, "array", 0, 2048)])
    landed = torch.frombuffer(bytearray(array.tobytes()[:2048]), dtype=torch.bfloat16)
    assert torch.equal(landed, tensor)


@pytest.mark.parametrize(("scheme", "dtype", "torch_dtype"),
                         [("fp8", "bfloat16", torch.bfloat16), ("int8", "float32", torch.float32)])
async def test_compressed_write_lands_within_the_error_bound(
        pair: Pair, scheme: str, dtype: str, torch_dtype: torch.dtype) -> None:
    values = torch.frombuffer(pair.source_kv, dtype=torch_dtype)
    values.copy_(torch.randn(values.numel()))
    codec = compression.make(scheme, dtype)
    result = await pair.source.write(pair.target.config.engine_id,
                                     [("kv", 0, "kv", 0, SEGMENT_BYTES)], compression=codec)
    landed = torch.frombuffer(pair.target_kv, dtype=torch_dtype).float()
    error = (landed - values.float()).abs().max().item()
    # Shared memory moves bytes as they are: exact, and it says so.
    expected = None if pair.transport == "shm" else scheme
    assert result.compression == expected
    if expected is None:
        assert error == 0
    else:
        assert 0 < error < 0.5


async def test_a_piece_outside_the_remote_segment_is_refused_before_sending(
        pair: Pair) -> None:
    fill(pair.source_kv, 8)
    with pytest.raises(InvalidTransfer, match="outside segment 'kv'"):
        await pair.source.write(pair.target.config.engine_id,
                                [("kv", 0, "kv", SEGMENT_BYTES - 10, 11)])
    assert pair.target_kv == bytes(SEGMENT_BYTES)


async def test_an_unknown_segment_is_refused(pair: Pair) -> None:
    with pytest.raises(InvalidTransfer, match="no segment 'nope'"):
        await pair.source.write(pair.target.config.engine_id, [("kv", 0, "nope", 0, 10)])
    with pytest.raises(InvalidTransfer, match="no local segment named 'nope'"):
        await pair.source.write(pair.target.config.engine_id, [("nope", 0, "kv", 0, 10)])


async def test_an_unknown_peer_is_refused(pair: Pair) -> None:
    with pytest.raises(PeerNotFound, match="'ghost'"):
        await pair.source.write("ghost", [("kv", 0, "kv", 0, 10)])


async def test_writes_after_close_are_refused(pair: Pair) -> None:
    await pair.source.close()
    with pytest.raises(InvalidTransfer, match="not running"):
        await pair.source.write(pair.target.config.engine_id, [("kv", 0, "kv", 0, 10)])




@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device here")]),
])
async def test_a_staged_tensor_is_read_from_and_written_to_its_device(
        pair: Pair, device: str) -> None:
    """Device tensors move through a host mirror; a CPU tensor can take the same path, which
    checks the mirror bookkeeping where there is no GPU."""
    source = torch.arange(4096, dtype=torch.float32, device=device)
    target = torch.zeros(4096, dtype=torch.float32, device=device)
    await pair.source.register("dev-src", source, is_staged=True)
    await pair.target.register("dev-dst", target, is_staged=True)
    peer = pair.target.config.engine_id
    result = await pair.source.write(peer, [("dev-src", 0, "dev-dst", 4096, 8192)])
    assert torch.equal(target[1024:3072], source[:2048])  # on the device, not just the mirror
    assert result.transport == pair.transport  # shm: into the mirror, the owner told
    target[:16] = 7.0  # changed on the device after registration: a read must see it
    await pair.source.read(peer, [("dev-src", 0, "dev-dst", 0, 64)])
    assert torch.equal(source[:16], torch.full((16,), 7.0, device=device))


@pytest.mark.parametrize("scheme", [None, "int8"])
async def test_a_staged_segment_s_device_copies_run_off_the_event_loop(
        pair: Pair, scheme: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes landing in a staged segment go on to its device, and a peer's read pulls them
    from it first: a copy per piece and a wait for the device, in a thread, never on the
    loop the owner serves every peer from (and its worker schedules from)."""
    threads: dict[str, set[int]] = {"to_device": set(), "to_host": set()}
    for name in threads:
        move = getattr(DeviceStaging, name)

        def recorded(self: DeviceStaging, *args: Any, _move: Any = move,
                     _name: str = name) -> None:
            threads[_name].add(threading.get_ident())
            _move(self, *args)

        monkeypatch.setattr(DeviceStaging, name, recorded)
    values = torch.randn(4096)
    target = torch.zeros(4096)
    await pair.source.register("values", values)
    await pair.target.register("dev", target, is_staged=True)
    peer = pair.target.config.engine_id
    codec = compression.make(scheme, "float32") if scheme else None
    await pair.source.write(peer, [("values", 0, "dev", 0, 16384)], compression=codec)
    assert torch.allclose(target, values, atol=0.05 if scheme else 0)  # on the "device"
    back = torch.zeros(4096)
    await pair.source.register("back", back)
    target[:8] = 3.0  # changed on the device: the read must pull it
    await pair.source.read(peer, [("back", 0, "dev", 0, 16384)])
    assert torch.equal(back, target)
    assert threads["to_device"] and threads["to_host"]
    assert threading.get_ident() not in threads["to_device"] | threads["to_host"]


class LoopTurns:
    """Counts the turns the event loop gives other tasks while it is counting."""

    def __init__(self) -> None:
        self.count = 0
        self._task = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

    def stop(self) -> int:
        self._task.cancel()
        return self.count


@pytest.mark.parametrize("size_mib", [12, 64])
async def test_a_large_shm_copy_leaves_the_event_loop_running(size_mib: int) -> None:
    """Up to 32 MiB a copy runs on the loop's thread in 4 MiB slices with a turn of the loop
    between them (cheaper than a thread hand-off); larger ones in a worker thread."""
    pair = await start_pair("shm")
    try:
        size = size_mib << 20
        source = await pair.source.allocate("big", size)
        target = await pair.target.allocate("big", size)
        source[:] = os.urandom(1 << 20) * size_mib
        turns = LoopTurns()
        await asyncio.sleep(0)
        before = turns.count
        result = await pair.source.write(pair.target.config.engine_id,
                                         [("big", 0, "big", 0, size)])
        assert result.transport == "shm" and turns.stop() > before + 1
        assert target == source
        back = await pair.source.allocate("back", size)
        await pair.source.read(pair.target.config.engine_id, [("back", 0, "big", 0, size)])
        assert back == target  # reads take the same path the other way
    finally:
        await pair.source.close()
        await pair.target.close()


async def test_closing_the_engine_stops_a_sliced_shm_copy_between_slices() -> None:
    pair = await start_pair("shm")
    try:
        size = 16 << 20
        await pair.source.allocate("big", size)
        await pair.target.allocate("big", size)
        writing = asyncio.create_task(pair.source.write(pair.target.config.engine_id,
                                                        [("big", 0, "big", 0, size)]))
        await asyncio.sleep(0)  # the first slice is copied; the write waits for its turn
        await pair.source.close()
        with pytest.raises(TransferFailed, match="closed"):
            await writing
    finally:
        await pair.source.close()
        await pair.target.close()


@pytest.mark.parametrize("op", ["notify", "stage"])
async def test_pieces_named_around_a_one_sided_copy_are_checked_by_their_owner(op: str) -> None:
    """A writer names what it copied into a staged segment's mirror (NOTIFY), a reader what
    it is about to copy (STAGE): the owner moves only pieces of its own segments, in bounds."""
    pair = await start_pair("shm")
    try:
        info = await pair.target.register("dev", torch.zeros(1024), is_staged=True)
        assert info.mirror_shm_name is not None and info.shm_name is None
        local = pair.source._memory.get("kv")
        outside = Run(local, info, np.array([0]), np.array([info.size_bytes - 32]),
                      np.array([64]))
        tcp = pair.source._tcp
        assert tcp is not None
        peer = pair.target.endpoint()
        naming = (tcp.notify(peer, [b"note"], 5.0, written=[outside]) if op == "notify"
                  else tcp.stage(peer, [outside], 5.0))
        with pytest.raises(InvalidTransfer, match="outside"):
            await naming
        assert pair.target.notifications.empty()
    finally:
        await pair.source.close()
        await pair.target.close()


async def test_a_staged_segment_without_room_in_shared_memory_is_reached_over_tcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    pair = await start_pair("shm")
    try:
        monkeypatch.setattr(memory_module, "SharedMemoryRegion", no_room)
        target = torch.zeros(1024)
        info = await pair.target.register("dev", target, is_staged=True)
        assert info.mirror_shm_name is None  # a private mirror
        pair.source_kv[:64] = bytes(range(64))
        result = await pair.source.write(pair.target.config.engine_id,
                                         [("kv", 0, "dev", 0, 64)])
        assert result.transport == "tcp"
        assert bytes(target.numpy().tobytes()[:64]) == bytes(range(64))
    finally:
        await pair.source.close()
        await pair.target.close()
