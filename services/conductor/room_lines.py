"""Requests waiting for room: lines per model, first come, first placed.

A request that finds no room for it now waits in a line of its model while its conductor
keeps its delivery in hand. Room is what placing it needs and what clears up on its own: a
healthy worker of each role (one restarting, stalled, cut off by a partition or loading the
model comes back: `NoHealthyWorker`) and space on it (`Shortage`: no decode worker of its
model with KV room, or every prefill worker's queue full; running requests free both as they
finish); each has its line (`holding.line_of`: one for room, one per missing role), and a
request that tries again and finds that it now waits for something else goes into that line
where its arrival places it (ahead of those that came after it: a request that waited for a
prefill worker is not put behind the short prompts that came meanwhile). Each heartbeat of
a worker of the model (it may be back, or show room) gives the request at the head of each
line a turn to try again; a head that leaves (placed, refused, out of time) gives the next
one a turn at once, since what let it go may let the next go too. A newcomer of a model
with a line for room joins its back, so the room that frees goes to the requests that
waited longest, and nothing polls meanwhile.

A request's priority (`GenerateRequest.priority`, lower first) orders each line before its
arrival: a waiter stands behind those of its priority that came first and the more urgent,
ahead of the less urgent, and a newcomer more urgent than every waiter of its model's line
tries at once, as if none waited.

Before, such a request went back to the queue with a delay and was tried again blindly,
up to JetStream's delivery limit, in no order, and was refused after five seconds (or, when
the prefill queues were full, got a 503 as if no prefill worker were alive): a burst larger
than the pool got 429s though every request of it fitted alone, and a lone decode worker
stalled for longer than that failed every request it held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable

# Past its time a waiter tries on, this far apart, until its caller settles it (the caller
# refuses it once its hold is spent).
LATE_TRY_S = 0.05


class Waiter:
    """One request in a line; `turn` is set when it may try again. It stands by its
    priority, then by when its request arrived (Unix seconds; default: now)."""

    def __init__(self, line: str, request_id: str, priority: int = 0,
                 arrived_s: float | None = None) -> None:
        self.line = line
        self.request_id = request_id
        self.priority = priority
        self.arrived_s = time.time() if arrived_s is None else arrived_s
        self.turn = asyncio.Event()

    def __repr__(self) -> str:
        return f"Waiter({self.line!r}, {self.request_id!r})"


class RoomLines:
    """Lines by name: a model's (`holding.line_of` names them)."""

    def __init__(self) -> None:
        self._lines: dict[str, deque[Waiter]] = {}
        self.is_closed = False  # the conductor stops: every waiter is woken to go

    def __len__(self) -> int:
        return sum(len(line) for line in self._lines.values())

    def has_line(self, name: str, priority: int = 0) -> bool:
        """Whether line `name` holds a waiter of `priority` or a more urgent one (its head
        is its most urgent)."""
        line = self._lines.get(name)
        return bool(line) and line[0].priority <= priority

    def join(self, name: str, request_id: str, priority: int = 0,
             arrived_s: float | None = None) -> Waiter:
        """A place in the line where its priority and arrival put it (a request just come:
        at the back of its priority's part); its first turn comes with the next heartbeat
        of one of the model's workers (or when the waiters ahead leave)."""
        waiter = Waiter(name, request_id, priority, arrived_s)
        self._stand(waiter)
        if self.is_closed:
            waiter.turn.set()
        return waiter

    async def wait(self, waiter: Waiter, time_left: Callable[[], float],
                   try_again: Callable[[], Awaitable[bool]]) -> bool:
        """Wait in the line, calling `try_again` at each turn (and once more when
        `time_left()`, asked before each wait, says its time is up) until it says the
        request is settled: True. False when the lines close first (the caller hands the
        request back). Out of the line either way."""
        try:
            while True:
                with contextlib.suppress(TimeoutError):  # past its time, a try each 50 ms
                    await asyncio.wait_for(waiter.turn.wait(),  # until the caller refuses it
                                           max(LATE_TRY_S, time_left()))
                waiter.turn.clear()
                if self.is_closed:
                    return False
                if await try_again():
                    return True
        finally:
            self.leave(waiter)

    def move(self, waiter: Waiter, name: str) -> None:
        """Into line `name` (what it waits for now is another line's), where its priority
        and arrival place it: ahead of those that came after it, which did not wait for
        what it waited for."""
        if waiter.line != name:
            self.leave(waiter)
            waiter.line = name
            self._stand(waiter)

    def _stand(self, waiter: Waiter) -> None:
        line = self._lines.setdefault(waiter.line, deque())
        place = (waiter.priority, waiter.arrived_s)
        line.insert(next((i for i, ahead in enumerate(line)
                          if (ahead.priority, ahead.arrived_s) > place), len(line)), waiter)

    def leave(self, waiter: Waiter) -> None:
        """Out of its line; when it was the head, the next one has a turn at once."""
        line = self._lines.get(waiter.line)
        if not line or waiter not in line:
            return
        was_head = line[0] is waiter
        line.remove(waiter)
        if not line:
            del self._lines[waiter.line]
        elif was_head:
            line[0].turn.set()

    def wake_head(self, name: str) -> None:
        """A worker of the line's model heartbeat: the line's head tries again."""
        line = self._lines.get(name)
        if line:
            line[0].turn.set()

    def wake(self, request_id: str) -> None:
        """The request's waiter, if one waits, tries again now (its gateway ended it)."""
        for line in self._lines.values():
            for waiter in line:
                if waiter.request_id == request_id:
                    waiter.turn.set()

    def close(self) -> None:
        """Every waiter wakes, to hand its request back (the conductor stops)."""
        self.is_closed = True
        for line in self._lines.values():
            for waiter in line:
                waiter.turn.set()
