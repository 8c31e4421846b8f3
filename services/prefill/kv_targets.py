"""Where each request's KV goes: the `KvTarget` its decode worker sends (while prefill
computes, or before the task arrives), as a future the request's run here awaits.

A target may come before the `PrefillTask` it belongs to (the conductor asks both sides at
once), for a request placed elsewhere (never claimed: let go after a while), or again when
decode was re-placed (the newest wins). An abort that makes way for a newer placement keeps
a target that placement's decode worker already sent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from services.superseded import Mark
from shared.errors import TransferTimeout
from shared.messages import KvTarget


class KvTargets:
    """Each request's KV target: a future, and when this worker first heard of it."""

    def __init__(self) -> None:
        self._targets: dict[str, tuple[asyncio.Future[KvTarget], float]] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._targets))

    def future(self, request_id: str) -> asyncio.Future[KvTarget]:
        """The request's target, to come (a future made now) or come already."""
        if request_id not in self._targets:
            self.fresh(request_id)
        return self._targets[request_id][0]

    def fresh(self, request_id: str) -> asyncio.Future[KvTarget]:
        """A new future for the request's next target (decode is being placed again)."""
        future: asyncio.Future[KvTarget] = asyncio.get_running_loop().create_future()
        self._targets[request_id] = (future, time.monotonic())
        return future

    def receive(self, target: KvTarget) -> None:
        future = self.future(target.request_id)
        if future.done():  # decode was re-placed: the newest target wins
            future = self.fresh(target.request_id)
        future.set_result(target)

    async def wait(self, request_id: str, timeout_s: float) -> KvTarget:
        try:
            return await asyncio.wait_for(asyncio.shield(self.future(request_id)), timeout_s)
        except TimeoutError as exc:
            raise TransferTimeout(
                f"no KV target from a decode worker within {timeout_s}s") from exc

    def decode_worker_of(self, request_id: str) -> str | None:
        """The decode worker holding the request's KV blocks, once its target came."""
        entry = self._targets.get(request_id)
        if entry is None or not entry[0].done() or entry[0].cancelled():
            return None
        return entry[0].result().decode_worker_id

    def first_heard_before(self, cutoff: float) -> list[str]:
        """The requests whose target this worker heard of before `cutoff` (monotonic)."""
        return [request_id for request_id, (_, seen_at) in self._targets.items()
                if seen_at < cutoff]

    def forget(self, request_id: str, *, keep_from: Mark | None = None) -> None:
        """Drop the request's target, unless it came from a placement from `keep_from` on."""
        entry = self._targets.get(request_id)
        if keep_from is None or entry is None or not _is_from(entry[0], keep_from):
            self._targets.pop(request_id, None)


def _is_from(future: asyncio.Future[KvTarget], mark: Mark) -> bool:
    """Whether a target came, from a reservation placed from `mark` or later."""
    if not future.done() or future.cancelled():
        return False
    target = future.result()
    return target.delivery > 0 and (target.attempt, target.delivery) >= mark
