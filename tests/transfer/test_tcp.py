"""What only the TCP transport does: merging queued writes, striping large ones, the direct
handshake, answers read straight from the received bytes, and random batches (hypothesis)
against a reference copy."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.transfer.conftest import SECRET, SEGMENT_BYTES, Pair, start_pair
from transfer_engine import wire
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.errors import PeerNotFound, ProtocolViolation, TransferFailed, TransferTimeout
from transfer_engine.registry import LocalEndpointRegistry
from transfer_engine.tcp_link import Job, Link, TcpStats


@pytest.fixture
async def tcp_pair() -> Pair:
    running = await start_pair("tcp", stripe_min_bytes=256 << 10, num_streams=4)
    yield running
    await running.source.close()
    await running.target.close()


async def test_concurrent_small_writes_to_one_peer_are_merged(tcp_pair: Pair) -> None:
    tcp_pair.source_kv[:] = os.urandom(SEGMENT_BYTES)
    target = tcp_pair.target.config.engine_id
    await tcp_pair.source.write(target, [("kv", 0, "kv", 0, 16)])  # open the link
    stats = tcp_pair.source.tcp_stats
    frames_before, transfers_before = stats.num_frames_sent, stats.num_transfers_sent
    await asyncio.gather(*(tcp_pair.source.write(target, [("kv", i * 4096, "kv", i * 4096, 4096)],
                                                 notify=b"%d" % i) for i in range(100)))
    assert stats.num_transfers_sent - transfers_before == 100
    assert stats.num_frames_sent - frames_before < 100
    assert tcp_pair.target_kv[:409600] == tcp_pair.source_kv[:409600]
    assert tcp_pair.target.notifications.qsize() == 100


async def test_large_and_small_transfers_in_flight_together_all_land(tcp_pair: Pair) -> None:
    """A payload received straight into memory (with the receive low-water mark raised) and
    small frames behind it on the same connection: none waits for bytes that never come."""
    tcp_pair.source_kv[:] = os.urandom(SEGMENT_BYTES)
    target = tcp_pair.target.config.engine_id
    half = SEGMENT_BYTES // 2
    sizes = [half - 8192, 16, 4096, 100, 3000]
    offsets = [0, half, half + 4096, half + 12288, half + 16384]
    await asyncio.gather(*(tcp_pair.source.write(target, [("kv", offset, "kv", offset, size)])
                           for offset, size in zip(offsets, sizes, strict=True)))
    for offset, size in zip(offsets, sizes, strict=True):
        assert tcp_pair.target_kv[offset:offset + size] == \
            tcp_pair.source_kv[offset:offset + size]
    await tcp_pair.source.read(target, [("kv", 0, "kv", 0, 200_000)])


async def test_a_short_deadline_behind_a_long_one_still_expires_on_time(
        tcp_pair: Pair) -> None:
    """One deadline timer per link: a transfer with a shorter timeout than one already in
    flight re-arms it, and the stalled link fails both with `TransferTimeout`."""
    target = tcp_pair.target.config.engine_id
    await tcp_pair.source.write(target, [("kv", 0, "kv", 0, 16)])  # open the link
    for inbound in list(tcp_pair.target._tcp.server._inbound):  # type: ignore[union-attr]
        inbound.pause()  # the peer stops reading: nothing is answered
    patient = asyncio.ensure_future(tcp_pair.source.write(target, [("kv", 0, "kv", 0, 16)],
                                                          timeout_s=30))
    await asyncio.sleep(0.05)
    started = asyncio.get_running_loop().time()
    with pytest.raises(TransferTimeout, match=r"did not finish within 0\.3 s"):
        await tcp_pair.source.write(target, [("kv", 16, "kv", 16, 16)], timeout_s=0.3)
    assert asyncio.get_running_loop().time() - started < 2
    with pytest.raises(TransferTimeout):
        await patient


async def test_writes_and_reads_beyond_the_output_queue_mark_land_whole_and_in_order() -> None:
    """24 MiB each way on one connection: the sender's queue passes its high-water mark
    (later writes wait, then merge), and so does the server's answer to a large read."""
    pair = await start_pair("tcp", stripe_min_bytes=1 << 30)  # one connection
    try:
        big = 24 << 20
        source = await pair.source.allocate("big", big)
        target = await pair.target.allocate("big", big)
        source[:] = os.urandom(1 << 20) * 24
        target_id = pair.target.config.engine_id
        small = [pair.source.write(target_id, [("kv", i * 4096, "kv", i * 4096, 4096)],
                                   notify=b"%d" % i) for i in range(50)]
        pair.source_kv[:] = os.urandom(SEGMENT_BYTES)
        await asyncio.gather(pair.source.write(target_id, [("big", 0, "big", 0, big)]), *small)
        assert target == source
        assert pair.target_kv[:50 * 4096] == pair.source_kv[:50 * 4096]
        payloads = [(await pair.target.notifications.get()).payload for _ in range(50)]
        assert payloads == [b"%d" % i for i in range(50)]
        target[:] = os.urandom(1 << 20) * 24
        await pair.source.read(target_id, [("big", 0, "big", 0, big)])
        assert source == target
    finally:
        await pair.source.close()
        await pair.target.close()


async def test_a_large_write_is_striped_over_several_connections(tcp_pair: Pair) -> None:
    tcp_pair.source_kv[:] = os.urandom(SEGMENT_BYTES)
    result = await tcp_pair.source.write(tcp_pair.target.config.engine_id,
                                         [("kv", 0, "kv", 0, SEGMENT_BYTES)], notify=b"done")
    assert tcp_pair.source.tcp_stats.num_links_opened == 4
    assert tcp_pair.target_kv == tcp_pair.source_kv
    assert result.num_bytes == SEGMENT_BYTES
    assert (await tcp_pair.target.notifications.get()).payload == b"done"


async def test_a_peer_is_reachable_by_address_without_a_registry(tcp_pair: Pair) -> None:
    loner = TransferEngine(TransferConfig(engine_id="loner", secret=SECRET,
                                          transports=("tcp",)))
    await loner.start()
    try:
        await loner.register("buf", bytearray(b"hello world"))
        with pytest.raises(PeerNotFound):
            await loner.write(tcp_pair.target.config.engine_id, [("buf", 0, "kv", 0, 11)])
        port = tcp_pair.target.endpoint().tcp_port
        result = await loner.write(f"tcp://127.0.0.1:{port}", [("buf", 0, "kv", 0, 11)])
        assert result.transport == "tcp"
        assert tcp_pair.target_kv[:11] == b"hello world"
    finally:
        await loner.close()


@pytest.fixture(scope="module")
def own_loop_pair() -> Iterator[tuple[asyncio.AbstractEventLoop, Pair]]:
    """Hypothesis drives a synchronous test, so this pair runs on its own event loop."""
    loop = asyncio.new_event_loop()
    pair = loop.run_until_complete(start_pair("tcp", stripe_min_bytes=64 << 10))
    yield loop, pair
    loop.run_until_complete(pair.source.close())
    loop.run_until_complete(pair.target.close())
    loop.close()


pieces = st.lists(st.tuples(st.integers(0, SEGMENT_BYTES - 1), st.integers(0, SEGMENT_BYTES - 1),
                            st.integers(1, 200_000)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None)
@given(batch=pieces, seed=st.integers(0, 1 << 30))
def test_random_batches_land_exactly_as_a_reference_copy_says(
        own_loop_pair: tuple[asyncio.AbstractEventLoop, Pair],
        batch: list[tuple[int, int, int]], seed: int) -> None:
    loop, pair = own_loop_pair
    pair.source_kv[:] = seed.to_bytes(4, "little") * (SEGMENT_BYTES // 4)
    pair.source_kv[:SEGMENT_BYTES // 2] = os.urandom(SEGMENT_BYTES // 2)
    expected = bytearray(pair.target_kv)
    used: list[tuple[int, int]] = []
    transfer = []
    for local, remote, length in batch:
        length = min(length, SEGMENT_BYTES - local, SEGMENT_BYTES - remote)
        if any(remote < end and start < remote + length for start, end in used):
            continue  # a batch's targets must not overlap; the order would be unspecified
        used.append((remote, remote + length))
        expected[remote:remote + length] = pair.source_kv[local:local + length]
        transfer.append(("kv", local, "kv", remote, length))
    loop.run_until_complete(pair.source.write(pair.target.config.engine_id, transfer))
    assert pair.target_kv == expected


async def test_an_engine_listening_everywhere_advertises_a_reachable_address() -> None:
    registry = LocalEndpointRegistry()
    listener = TransferEngine(TransferConfig(engine_id="everywhere", secret=SECRET,
                                             transports=("tcp",), listen_host="0.0.0.0"),
                              registry)
    caller = TransferEngine(TransferConfig(engine_id="caller", secret=SECRET,
                                           transports=("tcp",)), registry)
    await listener.start()
    await caller.start()
    try:
        assert listener.endpoint().tcp_host not in ("0.0.0.0", "")
        target = await listener.allocate("kv", 64)
        await caller.register("buf", bytearray(b"x" * 64))
        await caller.write("everywhere", [("buf", 0, "kv", 0, 64)])
        assert bytes(target) == b"x" * 64
    finally:
        await caller.close()
        await listener.close()


async def test_answers_read_together_settle_each_transfer_and_a_stray_one_fails_the_link() -> None:
    """The sending side takes plain ACKs straight from the bytes received (`Link.skim`):
    three arriving in one segment, out of order, settle their transfers; an ACK for no
    transfer in flight (then parsed by the steps) closes the link with a typed error instead
    of being skipped."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ours = socket.create_connection(listener.getsockname())
        theirs, _ = listener.accept()
    ours.setblocking(False)
    link = Link(ours, "peer", TcpStats())
    link.start()
    try:
        loop = asyncio.get_running_loop()
        jobs = [Job(wire.Op.NOTIFY, [], loop.create_future(), [b"%d" % i]) for i in range(3)]
        for job in jobs:
            job.deadline, job.timeout_s = loop.time() + 5, 5
            link.submit(job)
        await asyncio.sleep(0.05)  # requests 1, 2 and 3 (a NOTIFY is never merged)
        theirs.sendall(wire.ack(2) + wire.ack(3) + wire.ack(1))
        await asyncio.wait_for(asyncio.gather(*(job.future for job in jobs)), 5)
        late = Job(wire.Op.NOTIFY, [], loop.create_future(), [b"late"])
        late.deadline, late.timeout_s = loop.time() + 5, 5
        link.submit(late)
        theirs.sendall(wire.ack(99))
        with pytest.raises(ProtocolViolation, match="unexpected ACK for request 99"):
            await asyncio.wait_for(late.future, 5)
        assert not link.is_alive
    finally:
        link.close(TransferFailed("test over"))
        theirs.close()
