"""The planner at work in a conductor: one replica at a time holds the planner's lease (a key
in a NATS KV bucket whose entries expire), reads the cluster's heartbeats every interval,
asks the policy (`planner.py`) for a decision and sends each of its moves as a `RoleChange`
to its worker (and, with no move to make, each decode worker to shed load a `ShedLoad`).

The lease: the holder rewrites the key every interval (compare-and-set on its revision);
the bucket's entries expire after three intervals, so when the holder dies or is cut off
another conductor's `create` succeeds within that time. A decision's moves run as one task
while the loop goes on renewing; nothing new is decided until every move is answered. Every move is
logged, counted (`halfmoon_planner_moves_total`) and traced (`planner.move`, with the
pressures and the split it was decided on).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from services.conductor.planner import (
    Move,
    Planner,
    PlannerRules,
    Shed,
    SloRejections,
    splits,
)
from shared import tracing
from shared.config import ConductorConfig
from shared.errors import ConfigError, WorkerUnavailable
from shared.heartbeats import WorkerDirectory
from shared.jetstream_assets import ensure_bucket
from shared.logs import get_logger
from shared.messages import DispatchReply, Message, RoleChange, ShedLoad, WorkerHeartbeat
from shared.metrics import ConductorMetrics
from shared.nats_client import dispatch
from shared.subjects import Subjects

log = get_logger(__name__)

LEASE_INTERVALS = 3  # the lease outlives this many missed renewals
COMMAND_TIMEOUT_S = 10.0  # a worker answers once the new role takes work, or once it shed


class KvLease:
    """Leadership as one key of a KV bucket with expiring entries."""

    def __init__(self, kv: KeyValue, key: str, holder: str) -> None:
        self._kv, self._key, self._holder = kv, key, holder.encode()
        self._revision: int | None = None

    @property
    def is_held(self) -> bool:
        return self._revision is not None

    async def hold(self) -> bool:
        """Take the lease or renew it; whether this holder has it now."""
        try:
            if self._revision is None:
                self._revision = await self._kv.create(self._key, self._holder)
            else:
                self._revision = await self._kv.update(self._key, self._holder,
                                                       last=self._revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            self._revision = None  # another holder has it
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("planner.lease_unreachable", error=repr(exc))
            self._revision = None  # cannot prove it is still ours: act as if lost
        return self._revision is not None

    async def release(self) -> None:
        if self._revision is None:
            return
        revision, self._revision = self._revision, None
        with contextlib.suppress(Exception):  # expiring is the fallback
            await asyncio.wait_for(self._kv.delete(self._key, last=revision), 1.0)


def planner_rules(config: ConductorConfig) -> PlannerRules:
    planning = config.planning
    if config.ttft_slo_ms is None and config.tbt_slo_ms is None:
        raise ConfigError("--planner slo plans against the SLOs: set --ttft-slo-ms and/or "
                          "--tbt-slo-ms")
    if not 0 < planning.low < planning.high:
        raise ConfigError(f"planner_low ({planning.low}) must be above 0 and below "
                          f"planner_high ({planning.high})")
    return PlannerRules(
        ttft_slo_s=config.ttft_slo_ms / 1000 if config.ttft_slo_ms is not None else None,
        tbt_slo_s=config.tbt_slo_ms / 1000 if config.tbt_slo_ms is not None else None,
        high=planning.high, low=planning.low, hold_s=planning.hold_s,
        cooldown_s=planning.cooldown_s, home_after_s=planning.home_after_s,
        default_tokens_per_s=config.default_prefill_tokens_per_s)


class PlanningLoop:
    """Runs the planner while this conductor holds the lease."""

    def __init__(self, config: ConductorConfig, nc: NatsClient, subjects: Subjects,
                 workers: WorkerDirectory, metrics: ConductorMetrics, holder_id: str,
                 spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]]) -> None:
        self.config, self.nc, self.subjects = config, nc, subjects
        self.workers, self.metrics, self.holder_id = workers, metrics, holder_id
        self.planner = Planner(planner_rules(config))
        # This conductor's admission rejections; the work queue spreads requests over the
        # conductors, so the lease holder's share shows the cluster's.
        self.slo_rejections = SloRejections()
        self._spawn = spawn
        self._moving: asyncio.Task[None] | None = None
        self.moves: list[tuple[Move, str]] = []  # (move, outcome), for tests and logs
        self.sheds: list[tuple[Shed, str]] = []  # (shed, outcome)

    async def run(self) -> None:
        interval_s = self.config.planning.interval_s
        kv = await ensure_bucket(self.nc.jetstream(), self.subjects.planner_bucket,
                                 ttl_s=LEASE_INTERVALS * interval_s,
                                 replicas=self.config.js_replicas)
        lease = KvLease(kv, self.subjects.planner_lease, self.holder_id)
        try:
            while True:
                was_held = lease.is_held
                is_held = await lease.hold()
                if is_held != was_held:
                    log.info("planner.lease", holder=self.holder_id, is_held=is_held)
                    self.metrics.planner_leader.set(1 if is_held else 0)
                if is_held:
                    self.plan()
                await asyncio.sleep(interval_s)
        finally:  # stopping: hand the lease over now rather than when it expires
            await lease.release()

    def plan(self) -> None:
        """Decide once; the moves go out as their own task."""
        workers, now_s = self._view(), time.monotonic()
        rejected = self.slo_rejections.within(now_s, 2 * self.config.planning.interval_s)
        found = splits(workers, self.planner.rules, rejected)
        for split in found:
            self.metrics.planner_pressure.labels(split.model, "prefill").set(
                split.prefill_pressure)
            self.metrics.planner_pressure.labels(split.model, "decode").set(
                split.decode_pressure)
        if self._moving is not None:
            return  # one decision at a time
        moves = self.planner.decide_on(found, now_s)
        sheds = [] if moves else self.planner.sheds(found, now_s)
        if moves or sheds:
            self._moving = self._spawn(self._apply_all(moves, sheds), "planner.moves")

    async def _apply_all(self, moves: list[Move], sheds: list[Shed]) -> None:
        try:
            await asyncio.gather(*(self._apply(move) for move in moves),
                                 *(self._shed(shed) for shed in sheds))
        finally:
            self._moving = None

    def _view(self) -> list[WorkerHeartbeat]:
        return [*self.workers.healthy("prefill"), *self.workers.healthy("decode")]

    async def _apply(self, move: Move) -> None:
        split = move.split
        inputs = {"halfmoon.worker": move.worker_id, "halfmoon.model": split.model,
                  "halfmoon.to_model": move.to_model or split.model,
                  "halfmoon.from_role": move.from_role, "halfmoon.to_role": move.to_role,
                  "halfmoon.reason": move.reason,
                  "halfmoon.prefill_pressure": round(split.prefill_pressure, 4),
                  "halfmoon.decode_pressure": round(split.decode_pressure, 4),
                  "halfmoon.num_prefill": len(split.prefill),
                  "halfmoon.num_decode": len(split.decode)}
        outcome = "failed"
        try:
            outcome = await self._command(
                "planner.move", inputs, self.subjects.role_change(move.worker_id),
                RoleChange(role=move.to_role, reason=move.reason, requested_by=self.holder_id,
                           model=move.to_model))
        finally:
            self.metrics.planner_moves.labels(move.to_role, outcome).inc()
            self.moves.append((move, outcome))

    async def _shed(self, shed: Shed) -> None:
        inputs = {"halfmoon.worker": shed.worker_id, "halfmoon.model": shed.split.model,
                  "halfmoon.num_requests": shed.num_requests, "halfmoon.reason": shed.reason,
                  "halfmoon.prefill_pressure": round(shed.split.prefill_pressure, 4),
                  "halfmoon.num_decode": len(shed.split.decode)}
        outcome = "failed"
        try:
            outcome = await self._command(
                "planner.shed", inputs, self.subjects.shed_load(shed.worker_id),
                ShedLoad(num_requests=shed.num_requests, reason=shed.reason,
                         requested_by=self.holder_id))
        finally:
            self.metrics.planner_sheds.labels(outcome).inc()
            self.sheds.append((shed, outcome))

    async def _command(self, name: str, inputs: dict[str, Any], subject: str,
                       command: Message) -> str:
        """Send one decision's command to its worker, logged and traced (`name`, with the
        decision's inputs); its outcome: done, refused or failed."""
        worker = inputs["halfmoon.worker"]
        log.info(name, **{k.removeprefix("halfmoon."): v for k, v in inputs.items()})
        with tracing.span(__name__, name, attributes=inputs) as span:
            outcome = "failed"
            try:
                reply: DispatchReply = await dispatch(self.nc, subject, command,
                                                      COMMAND_TIMEOUT_S)
                outcome = "done" if reply.is_accepted else "refused"
                if not reply.is_accepted:
                    log.warning(f"{name}_refused", worker=worker, reason=reply.reason)
            except WorkerUnavailable as exc:
                log.warning(f"{name}_failed", worker=worker, error=exc.message)
            if span is not None:
                span.set_attribute("halfmoon.outcome", outcome)
        return outcome
