"""`bench.engine_throughput`'s default: each party (ours, the before engine, transformers) in
a process of its own, as a worker process holds one engine (`--in-process` runs all three in
the bench's process instead).

In one process the three hold three OpenMP teams, more threads than a small host has cores,
and libgomp then puts each team's idle workers to sleep after every parallel region, so all
three pay a wake-up per operator (`engine.compute_threads`). Here each party computes with
one team in its own spawned process, set up as a worker sets itself up (a torch engine's
event-loop thread and executor compute serially, its engine thread on every core;
transformers computes on its process's main thread), and only one computes at a time: the
parent sends a workload, the party runs it and answers its tokens/s.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.compute_threads import serial_executor
from engine.torch_engine import EngineOptions, TorchEngine

TRANSFORMERS = "transformers"
READY = "ready"


class PartyFailed(RuntimeError):
    """A party's process raised; the message carries its traceback."""


class PartyProcess:
    """One party in a spawned process: `TRANSFORMERS` (the model in `model_dir`) or a torch
    engine with `engine_options`. `measure` runs one workload there (blocking)."""

    def __init__(self, name: str, model_dir: Path, dtype: torch.dtype,
                 engine_options: dict[str, Any] | None = None) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=serve, args=(theirs, name, model_dir, dtype, engine_options),
            name=f"bench-{name}", daemon=True)
        self._process.start()
        theirs.close()
        self._answer()  # set up, warmed up

    def measure(self, workload: str, *args: int) -> float:
        """Tokens/s of `workload` ("prefill": length, salt; "decode": batch, new tokens,
        salt) run in the party's process."""
        self._conn.send((workload, args))
        return float(self._answer())

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
        self._conn.close()

    def _answer(self) -> Any:
        try:
            reply = self._conn.recv()
        except EOFError as exc:
            raise PartyFailed(f"{self._process.name} exited "
                              f"({self._process.exitcode})") from exc
        if isinstance(reply, PartyFailed):
            raise reply
        return reply


def serve(conn: Connection, name: str, model_dir: Path, dtype: torch.dtype,
          engine_options: dict[str, Any] | None) -> None:
    """The party process: set up, say `READY`, then answer each workload until told None."""
    try:
        if name == TRANSFORMERS:
            _serve_transformers(conn, model_dir, dtype)
        else:
            asyncio.run(_serve_engine(conn, model_dir, dtype, engine_options or {}))
    except Exception:
        conn.send(PartyFailed(f"{name}: {traceback.format_exc()}"))
    finally:
        conn.close()


def _serve_transformers(conn: Connection, model_dir: Path, dtype: torch.dtype) -> None:
    from transformers import LlamaForCausalLM

    from bench.engine_throughput import THEIRS

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=dtype).eval()
    THEIRS["prefill"](model, 64, 999)  # warm-up
    conn.send(READY)
    while (command := conn.recv()) is not None:
        workload, args = command
        conn.send(THEIRS[workload](model, *args))


async def _serve_engine(conn: Connection, model_dir: Path, dtype: torch.dtype,
                        engine_options: dict[str, Any]) -> None:
    from bench.engine_throughput import OURS

    serial_executor(asyncio.get_running_loop())  # as a worker process, before anything runs
    engine = TorchEngine(EngineOptions(model_dir=model_dir, dtype=dtype, **engine_options))
    await engine.start()
    try:
        await OURS["prefill"](engine, 64, 999)  # warm-up
        conn.send(READY)
        while (command := conn.recv()) is not None:  # the engine is idle meanwhile
            workload, args = command
            conn.send(await OURS[workload](engine, *args))
    finally:
        await engine.close()
