"""A live view of workers, built from their heartbeats (conductor placement, gateway health)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.messages import WorkerHeartbeat, WorkerRole


@dataclass
class WorkerEntry:
    heartbeat: WorkerHeartbeat
    received_at_s: float  # monotonic clock of the receiver


class WorkerDirectory:
    """Latest heartbeat per worker. A worker is healthy while its last heartbeat is younger
    than `timeout_s` (and never younger than three of its own intervals) and it is not
    draining. Stale entries are forgotten after ten timeouts.

    No news is not bad news while the reader itself is cut off from NATS: between
    `suspend()` (its connection dropped) and `resume()` (it is back) every judgment is made
    as of the moment it dropped, and on resuming every entry counts as heard from then, so a
    worker that kept running has a whole timeout (at least three of its heartbeats) to be
    heard again before it is lost."""

    def __init__(self, timeout_s: float,
                 on_expire: Callable[[str], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self._entries: dict[str, WorkerEntry] = {}
        self._on_expire = on_expire
        self._suspended_at: float | None = None

    def suspend(self, now_s: float | None = None) -> None:
        """This reader lost its NATS connection: stop judging by silence."""
        if self._suspended_at is None:
            self._suspended_at = time.monotonic() if now_s is None else now_s

    def resume(self, now_s: float | None = None) -> None:
        """Reconnected: every worker counts as heard from now on."""
        if self._suspended_at is None:
            return
        now_s = time.monotonic() if now_s is None else now_s
        for entry in self._entries.values():
            entry.received_at_s = max(entry.received_at_s, now_s)
        self._suspended_at = None

    def excuse_silence(self, now_s: float | None = None) -> None:
        """This reader heard nothing for a while though connected (its own loop stalled):
        every worker counts as heard from now on, as after `resume`. No effect while
        suspended: the reconnection decides then."""
        if self._suspended_at is None:
            self._suspended_at = time.monotonic() if now_s is None else now_s
            self.resume(now_s)

    def _now(self, now_s: float | None) -> float:
        if self._suspended_at is not None:
            return self._suspended_at
        return time.monotonic() if now_s is None else now_s

    def observe(self, heartbeat: WorkerHeartbeat, now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        self._entries[heartbeat.worker_id] = WorkerEntry(heartbeat, now_s)

    def observe_entry(self, heartbeat: WorkerHeartbeat) -> None:
        """A heartbeat read back from the registry: date it by its own send time."""
        age_s = max(0.0, time.time() - heartbeat.sent_at_s)
        self.observe(heartbeat, now_s=time.monotonic() - age_s)

    def get(self, worker_id: str | None) -> WorkerHeartbeat | None:
        entry = self._entries.get(worker_id) if worker_id is not None else None
        return entry.heartbeat if entry is not None else None

    def started_at_s(self, worker_id: str) -> float:
        """When the worker heard last started serving (`WorkerHeartbeat.started_at_s`); 0
        when unknown."""
        entry = self._entries.get(worker_id)
        return entry.heartbeat.started_at_s if entry is not None else 0.0

    def block_size(self, worker_id: str, default: int = 16) -> int:
        entry = self._entries.get(worker_id)
        return entry.heartbeat.block_size if entry is not None else default

    def is_alive(self, worker_id: str, now_s: float | None = None) -> bool:
        """Heartbeats are fresh (a draining worker is alive: it finishes what it holds)."""
        entry = self._entries.get(worker_id)
        return entry is not None and self._is_fresh(entry, self._now(now_s))

    def is_lost(self, worker_id: str, now_s: float | None = None) -> bool:
        """Heard from once, and silent since for longer than the timeout (unknown workers
        are not lost: nothing is known of them)."""
        entry = self._entries.get(worker_id)
        return entry is not None and not self._is_fresh(entry, self._now(now_s))

    def is_healthy(self, worker_id: str, now_s: float | None = None) -> bool:
        entry = self._entries.get(worker_id)
        now_s = self._now(now_s)
        return entry is not None and self._is_fresh(entry, now_s) and (
            not entry.heartbeat.is_draining
        )

    def healthy(self, role: WorkerRole, now_s: float | None = None, *,
                model: str | None = None) -> list[WorkerHeartbeat]:
        """Healthy workers of `role` (serving `model`, if given), ordered by worker id (a
        stable order for placement)."""
        return sorted((hb for hb in self.alive(role, now_s) if not hb.is_draining
                       and (model is None or hb.model == model)),
                      key=lambda hb: hb.worker_id)

    def alive(self, role: WorkerRole, now_s: float | None = None) -> list[WorkerHeartbeat]:
        """Live workers of `role`, draining ones too (they still hold what they serve)."""
        now_s = self._now(now_s)
        self._expire(now_s)
        return [e.heartbeat for e in self._entries.values()
                if e.heartbeat.role == role and self._is_fresh(e, now_s)]

    def models(self, now_s: float | None = None, *, is_alive: bool = False,
               is_on_disk: bool = False) -> set[str]:
        """The models workers serve: every one still remembered, or only live workers';
        with `is_on_disk`, those they could load too (`models_on_disk`)."""
        now_s = self._now(now_s)
        self._expire(now_s)
        found: set[str] = set()
        for entry in self._entries.values():
            if not is_alive or self._is_fresh(entry, now_s):
                found.add(entry.heartbeat.model)
                found.update(entry.heartbeat.models_on_disk if is_on_disk else ())
        return found

    def model_paths(self, model: str) -> list[str]:
        """Where workers of `model` loaded it from (as they name it), each once."""
        return list(dict.fromkeys(e.heartbeat.model_path for e in self._entries.values()
                                  if e.heartbeat.model == model and e.heartbeat.model_path))

    def max_model_len(self, model: str, now_s: float | None = None) -> int | None:
        """The longest sequence every live worker of `model` holds (`None`: none says)."""
        now_s = self._now(now_s)
        limits = [e.heartbeat.max_model_len for e in self._entries.values()
                  if e.heartbeat.model == model and e.heartbeat.max_model_len
                  and self._is_fresh(e, now_s)]
        return min(limits, default=None)

    def _is_fresh(self, entry: WorkerEntry, now_s: float) -> bool:
        limit = max(self.timeout_s, 3 * entry.heartbeat.heartbeat_interval_s)
        return now_s - entry.received_at_s <= limit

    def _expire(self, now_s: float) -> None:
        stale = [wid for wid, e in self._entries.items()
                 if now_s - e.received_at_s > 10 * self.timeout_s]
        for worker_id in stale:
            del self._entries[worker_id]
            if self._on_expire is not None:
                self._on_expire(worker_id)
