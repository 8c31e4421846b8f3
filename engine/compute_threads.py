"""Which threads of a process compute with torch on all cores: the engine thread alone.

Torch's CPU kernels run in OpenMP teams, one per thread that starts a parallel region, and a
team's idle workers stay alive with their thread. Once the process holds more OpenMP
threads than cores (the event loop's team, an executor thread's, the engine's), libgomp
stops spinning between regions and puts workers to sleep after ~100 spins, so every
parallel region of the engine pays a futex wake-up: measured on a 2-core host, a 256 K
element `add` took 20 us on the only team and 76 us in a second one, and decode at batch 1
(fp32, the bench's 254 M Llama) ran 18.3 tok/s against 22.3 with the engine's team alone.

So every other thread that may touch torch is made serial (`serial_torch`: its OpenMP
threads set to 1, so it never starts a team): the event loop's thread and the loop's
default executor (`serial_executor`), as a worker starts.
"""

from __future__ import annotations

import asyncio
import ctypes
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shared.logs import get_logger

log = get_logger(__name__)

_OPENMP_LIBRARIES = ("libgomp", "libiomp5", "libomp")


def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (found among this process's mapped libraries)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if Path(path).name.startswith(_OPENMP_LIBRARIES) and ".so" in path:
            return ctypes.CDLL(path)
    return None


_runtime: ctypes.CDLL | None = None
_looked = False


def serial_torch() -> None:
    """Torch in the calling thread runs on one core (OpenMP threads: 1; the setting is the
    thread's own). Does nothing where no OpenMP runtime is loaded."""
    global _runtime, _looked
    if not _looked:
        import torch  # noqa: F401  (loads the OpenMP runtime it was built with)

        _runtime, _looked = _openmp(), True
        if _runtime is None:
            log.info("engine.openmp_not_found")
    if _runtime is not None:
        _runtime.omp_set_num_threads(1)


def serial_executor(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's thread and its default executor's threads compute serially (the
    executor's threads start from now: a worker does this before anything runs there)."""
    serial_torch()
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="serial",
                                                 initializer=serial_torch))
