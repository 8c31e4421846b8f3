"""Transfer-engine benchmark: two processes, our shm and tcp transports beside the limits
measured in the same run (a plain-socket sendall/recv_into loop between the same two
processes, and a single-process memcpy).

    python -m bench.transfer [--max-mib 256] [--seconds 0.5]   (or: halfmoon bench transfer)

GB/s is bytes / median wall seconds over repeats; a repeat ends when the receiver has every
byte (tcp and plain socket: its acknowledgement arrived; shm: the one-sided copy returned).
Ratios compare with the baselines of the same row. The batch rows (1,000 pieces at scattered
offsets) are compared with our own figure for large (>= 16 MiB) transfers.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import uvloop

from shared.logs import configure_logging
from transfer_engine.batch import PieceArrays
from transfer_engine.config import TransferConfig
from transfer_engine.engine import TransferEngine
from transfer_engine.segment import buffer_address

_SECRET_ENV = "HALFMOON_BENCH_SECRET"
_BATCHES = [(1000, 4 << 10), (1000, 64 << 10)]
_LARGE_BYTES = 16 << 20
# The receiver's segment that tcp writes land in: shm writes go to "kv", so that neither
# contender finds its target's cache lines owned by the other process's core (each
# baseline has a target of its own too).
_TCP_TARGET = "kv-tcp"


# --- the receiving process ----------------------------------------------------------------

async def _serve_engine(size: int, host: str, port_file: str | None) -> None:
    engine = TransferEngine(TransferConfig(engine_id="bench-receiver",
                                           secret=os.environ[_SECRET_ENV].encode(),
                                           transports=("shm", "tcp"), listen_host=host))
    await engine.start()
    await engine.allocate("kv", size)
    await engine.allocate(_TCP_TARGET, size)
    _announce(engine.endpoint().tcp_port, port_file)
    if port_file is None:
        await asyncio.to_thread(sys.stdin.read)  # serve until the parent closes our stdin
    else:
        await asyncio.Event().wait()  # serve until terminated (bench.cluster's hosts)
    await engine.close()


def _announce(port: int, port_file: str | None) -> None:
    """Tell the parent our port: on stdout, or in a file (written whole, then renamed)."""
    print(port, flush=True)
    if port_file is not None:
        Path(f"{port_file}.tmp").write_text(str(port))
        Path(f"{port_file}.tmp").rename(port_file)


def _serve_socket(size: int, host: str, port_file: str | None) -> None:
    """The TCP limit: each transfer is a piece count, a table of (offset, length) and the
    bytes, received with recv_into / recvmsg_into straight into place, then acknowledged."""
    listener = socket.create_server((host, 0))
    _announce(listener.getsockname()[1], port_file)
    buffer = memoryview(bytearray(size))
    count = bytearray(8)
    while True:  # one sender at a time, until terminated
        conn, _ = listener.accept()

        def receive(views: list[memoryview], conn: socket.socket = conn) -> int:
            return conn.recvmsg_into(views)[0]

        while _move_all(receive, [memoryview(count)]):
            table = bytearray(16 * int.from_bytes(count, "little"))
            _move_all(receive, [memoryview(table)])
            pieces = np.frombuffer(table, dtype=np.int64).reshape(-1, 2).tolist()
            _move_all(receive, [buffer[offset:offset + length] for offset, length in pieces])
            conn.sendall(b"k")
        conn.close()


def _move_all(move: Callable[[list[memoryview]], int], views: list[memoryview]) -> bool:
    """A blocking vectored send or receive of every view (`move` is sendmsg or recvmsg_into
    returning a byte count); False if the peer closed."""
    index = 0
    while index < len(views):
        done = move(views[index:index + 1024])
        if done == 0:
            return False
        while done:
            if done < views[index].nbytes:
                views[index] = views[index][done:]
                break
            done -= views[index].nbytes
            index += 1
    return True


# --- the measuring process ----------------------------------------------------------------

def _spawn(role: str, size: int, secret: str) -> tuple[subprocess.Popen[str], int]:
    child = subprocess.Popen([sys.executable, "-m", "bench.transfer", "--serve", role,
                              "--size", str(size)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, _SECRET_ENV: secret})
    assert child.stdout is not None
    return child, int(child.stdout.readline())


async def _race(runs: dict[str, Callable[[], Awaitable[None]]], num_bytes: int,
                seconds: float) -> dict[str, float]:
    """GB/s of each contender: median over rounds, one transfer of each per round in turn,
    so that whatever else the machine does hits all of them alike."""
    timings: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        await run()  # warm up: connections, mappings, page faults
    deadline = time.perf_counter() + seconds * len(runs)
    while len(timings[next(iter(runs))]) < 5 or (time.perf_counter() < deadline
                                                 and len(timings[next(iter(runs))]) < 2000):
        for name, run in runs.items():
            started = time.perf_counter()
            await run()
            timings[name].append(time.perf_counter() - started)
    return {name: num_bytes / statistics.median(times) / 1e9 for name, times in timings.items()}


def _scattered(num_pieces: int, piece_bytes: int, segment_bytes: int,
               seed: int) -> PieceArrays:
    """Pieces at random, non-adjacent slots on both sides (so nothing coalesces), in the
    array form a KV cache hands over (block ids times block bytes)."""
    rng = random.Random(seed)
    num_slots = segment_bytes // piece_bytes
    local = np.array(rng.sample(range(0, num_slots, 2), num_pieces)) * piece_bytes
    remote = np.array(rng.sample(range(0, num_slots, 2), num_pieces)) * piece_bytes
    return PieceArrays("kv", "kv", local, remote, np.full(num_pieces, piece_bytes))


class _PlainSocket:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def send(self, source: memoryview, batch: PieceArrays) -> None:
        # Blocking calls on purpose: this is the plain loop our transport is measured against.
        table = np.stack([batch.remote_offsets, batch.lengths], axis=1).astype(np.int64)
        self._sock.sendall(len(batch.lengths).to_bytes(8, "little") + table.tobytes())
        views = [source[offset:offset + length] for offset, length
                 in zip(batch.local_offsets.tolist(), batch.lengths.tolist(), strict=True)]
        _move_all(self._sock.sendmsg, views)
        self._sock.recv(1)

    def close(self) -> None:
        self._sock.close()


async def _run(max_bytes: int, seconds: float) -> list[dict[str, object]]:
    secret = os.urandom(16).hex()
    segment_bytes = max(max_bytes, 128 << 20)
    receiver, engine_port = _spawn("engine", segment_bytes, secret)
    sink, socket_port = _spawn("socket", segment_bytes, secret)
    plain = _PlainSocket(socket_port)
    engines = {}
    for transport in ("shm", "tcp"):
        engine = TransferEngine(TransferConfig(engine_id=f"bench-{transport}",
                                               secret=secret.encode(),
                                               transports=(transport,)))
        await engine.start()
        engines[transport] = engine
    try:
        source = await engines["shm"].allocate("kv", segment_bytes)
        await engines["tcp"].register("kv", source)
        source[:] = os.urandom(1 << 20) * (segment_bytes >> 20)
        copy_target = await engines["shm"].allocate("copy-target", segment_bytes)
        peer = f"tcp://127.0.0.1:{engine_port}"
        rows = []
        shapes: list[tuple[str, PieceArrays]] = []
        size = 4 << 10
        while size <= max_bytes:
            shapes.append((_size_label(size), PieceArrays("kv", "kv", np.zeros(1, np.int64),
                                                           np.zeros(1, np.int64),
                                                           np.full(1, size))))
            size *= 4 if size < (1 << 20) else 2 if size < (16 << 20) else 4
        for num_pieces, piece_bytes in _BATCHES:
            shapes.append((f"{num_pieces} x {_size_label(piece_bytes)}",
                           _scattered(num_pieces, piece_bytes, segment_bytes, piece_bytes)))
        for label, batch in shapes:
            num_bytes = int(batch.lengths.sum())
            row: dict[str, object] = {"shape": label, "bytes": num_bytes}
            row.update(await _race({
                "shm": lambda batch=batch: engines["shm"].write(peer, batch),
                "tcp": lambda batch=batch: engines["tcp"].write(peer, _to_tcp_target(batch)),
                "socket": lambda batch=batch: plain.send(source, batch),
                "memcpy": lambda batch=batch: _memcpy(copy_target, source, batch),
            }, num_bytes, seconds))
            rows.append(row)
            print(_format(row), flush=True)
        return rows
    finally:
        plain.close()
        for engine in engines.values():
            await engine.close()
        for child in (receiver, sink):
            assert child.stdin is not None
            child.stdin.close()
            child.terminate() if child is sink else None
            child.wait(timeout=10)


def _to_tcp_target(batch: PieceArrays) -> PieceArrays:
    return dataclasses.replace(batch, remote_segment=_TCP_TARGET)


async def _send_to(host: str, engine_port: int, socket_port: int, sizes: list[int],
                   seconds: float) -> None:
    """The sending side across hosts (bench.cluster): one JSON row per size on stdout,
    our tcp transport against the plain socket over the same link."""
    engine = TransferEngine(TransferConfig(engine_id="bench-sender",
                                           secret=os.environ[_SECRET_ENV].encode(),
                                           transports=("tcp",)))
    await engine.start()
    plain = _PlainSocket(socket_port, host)
    try:
        source = await engine.allocate("kv", max(sizes))
        source[:] = os.urandom(1 << 20) * (max(sizes) >> 20)
        peer = f"tcp://{host}:{engine_port}"
        for size in sizes:
            batch = PieceArrays("kv", "kv", np.zeros(1, np.int64), np.zeros(1, np.int64),
                                np.full(1, size))
            row: dict[str, object] = {"bytes": size}
            row.update(await _race({
                "tcp": lambda batch=batch: engine.write(peer, batch),
                "socket": lambda batch=batch: plain.send(source, batch),
            }, size, seconds))
            print(json.dumps(row), flush=True)
    finally:
        plain.close()
        await engine.close()


async def _memcpy(target: memoryview, source: memoryview, batch: PieceArrays) -> None:
    """The memory limit for the same pieces in one process, shared memory to shared memory:
    memmove per piece, or one numpy gather/scatter for small equal pieces (faster there)."""
    size = int(batch.lengths[0])
    if len(batch.lengths) > 1 and size <= 16 << 10:
        item = np.dtype((np.void, size))
        rows_in = np.frombuffer(source, np.uint8).view(item)
        rows_out = np.frombuffer(target, np.uint8).view(item)
        rows_out[batch.remote_offsets // size] = rows_in[batch.local_offsets // size]
        return
    sources = (buffer_address(source) + batch.local_offsets).tolist()
    targets = (buffer_address(target) + batch.remote_offsets).tolist()
    for to, start, length in zip(targets, sources, batch.lengths.tolist(), strict=True):
        ctypes.memmove(to, start, length)


def _size_label(num_bytes: int) -> str:
    return f"{num_bytes >> 20} MiB" if num_bytes >= 1 << 20 else f"{num_bytes >> 10} KiB"


_HEADER = (f"{'shape':>14} | {'shm GB/s':>9} {'tcp GB/s':>9} | {'socket':>7} {'memcpy':>7} | "
           f"{'tcp/socket':>10} {'shm/memcpy':>10}")


def _format(row: dict[str, object]) -> str:
    shm, tcp = float(row["shm"]), float(row["tcp"])  # type: ignore[arg-type]
    sock, mem = float(row["socket"]), float(row["memcpy"])  # type: ignore[arg-type]
    return (f"{row['shape']:>14} | {shm:9.2f} {tcp:9.2f} | {sock:7.2f} {mem:7.2f} | "
            f"{tcp / sock:10.0%} {shm / mem:10.0%}")


def _latencies(rows: list[dict[str, object]]) -> str:
    """The smallest single transfer as time per transfer (median round): the round trip."""
    row = rows[0]
    micros = {name: int(row["bytes"]) / float(row[name]) / 1e3  # type: ignore[call-overload,arg-type]
              for name in ("tcp", "socket", "shm", "memcpy")}
    return (f"{row['shape']}: tcp round trip {micros['tcp']:.0f} us (plain socket "
            f"{micros['socket']:.0f} us); shm write {micros['shm']:.0f} us (memcpy "
            f"{micros['memcpy']:.0f} us)")


def _summary(rows: list[dict[str, object]]) -> str:
    large = [row for row in rows if " x " not in str(row["shape"])
             and int(row["bytes"]) >= _LARGE_BYTES]  # type: ignore[call-overload]
    if not large:
        return "(no transfer of >= 16 MiB in this run)"
    lines = []
    for transport in ("shm", "tcp"):
        figure = statistics.median(float(row[transport]) for row in large)  # type: ignore[arg-type]
        for row in rows:
            if " x " in str(row["shape"]):
                ratio = float(row[transport]) / figure  # type: ignore[arg-type]
                lines.append(f"{transport}: {row['shape']} at {ratio:.0%} of its large-transfer "
                             f"figure ({figure:.2f} GB/s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="halfmoon bench transfer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-mib", type=int, default=256, help="largest transfer (MiB)")
    parser.add_argument("--seconds", type=float, default=0.5, help="time per measurement")
    # The two sides of a run across hosts (bench.cluster), and the children of a local run.
    parser.add_argument("--serve", choices=("engine", "socket"), help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--listen-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--send-to", help=argparse.SUPPRESS)
    parser.add_argument("--engine-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    configure_logging("warning")
    if args.serve == "engine":
        uvloop.run(_serve_engine(args.size, args.listen_host, args.port_file))
    elif args.serve == "socket":
        _serve_socket(args.size, args.listen_host, args.port_file)
    elif args.send_to:
        uvloop.run(_send_to(args.send_to, args.engine_port, args.socket_port,
                            [int(size) for size in args.sizes.split(",")], args.seconds))
    else:
        print(_HEADER, flush=True)
        rows = uvloop.run(_run(args.max_mib << 20, args.seconds))
        print(_latencies(rows))
        print(_summary(rows))


if __name__ == "__main__":
    main()
