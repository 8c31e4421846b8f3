"""The one bridge between the engine's compute thread and asyncio.

The event loop submits commands (closures) with `submit`; the thread runs them between model
steps, in order, then calls `step()` until it reports idle, then sleeps until the next command.
The thread posts results back with `post`, which schedules a callback on the event loop.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from shared.logs import get_logger

log = get_logger(__name__)

_STOP = object()


class EngineThread:
    def __init__(self, loop: asyncio.AbstractEventLoop, step: Callable[[], bool],
                 on_crash: Callable[[BaseException], None], name: str = "engine") -> None:
        self._loop = loop
        self._step = step
        self._on_crash = on_crash
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = asyncio.Event()
        self.failure: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    def post(self, callback: Callable[..., Any], *args: Any) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)

    async def stop(self) -> None:
        """Ask the thread to stop after its current step and wait for it."""
        if not self._thread.is_alive():
            return
        self._commands.put(_STOP)
        await self._stopped.wait()
        self._thread.join()

    def _run(self) -> None:
        try:
            self._loop_forever()
        except BaseException as exc:  # the thread must report, never die silently
            self.failure = exc
            log.error("engine.thread_crashed", exc_info=exc)
            self.post(self._on_crash, exc)
        finally:
            self.post(self._stopped.set)

    def _loop_forever(self) -> None:
        is_idle = True
        while True:
            try:
                command = self._commands.get(block=is_idle)
            except queue.Empty:
                command = None
            while command is not None:
                if command is _STOP:
                    return
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            is_idle = not self._step()
