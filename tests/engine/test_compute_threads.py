"""The engine thread is the one thread that computes on every core: the event loop's thread
and a worker's executor threads compute serially, so that they never start OpenMP teams
whose idle workers put the engine's to sleep between parallel regions."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch

from engine.compute_threads import serial_executor, serial_torch
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams
from tests.engine.test_torch_engine import run

CORES = len(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(CORES < 2, reason="one core: every thread is serial")


def threads_in_new_thread(*, is_serial: bool) -> int:
    seen: list[int] = []

    def work() -> None:
        if is_serial:
            serial_torch()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return seen[0]


def test_a_serial_thread_computes_on_one_core_and_no_other_thread_changes() -> None:
    assert threads_in_new_thread(is_serial=True) == 1
    assert threads_in_new_thread(is_serial=False) > 1


async def test_a_worker_s_executor_threads_compute_serially() -> None:
    serial_executor(asyncio.get_running_loop())
    assert await asyncio.to_thread(torch.get_num_threads) == 1
    assert torch.get_num_threads() == 1


def test_the_engine_thread_computes_on_every_core_and_the_loop_serially(
        llama_dir: Path) -> None:
    """On a loop in a thread of its own (one that has computed nothing yet)."""
    steps: list[tuple[str, int]] = []
    loop_threads: list[int] = []

    async def serve() -> None:
        engine = TorchEngine(EngineOptions(model_dir=llama_dir, num_blocks=64, block_size=4))
        await engine.start()
        execute = engine.runner.execute

        def recorded(*args: object) -> object:
            steps.append((threading.current_thread().name, torch.get_num_threads()))
            return execute(*args)

        engine.runner.execute = recorded  # type: ignore[method-assign]
        try:
            await run(engine, "r", SamplingParams(max_tokens=3, temperature=0.0))
        finally:
            await engine.close()
        loop_threads.append(torch.get_num_threads())

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    thread.join()
    assert loop_threads == [1]
    assert steps and set(steps) == {("engine", threads_in_new_thread(is_serial=False))}
