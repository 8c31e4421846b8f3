"""A worker process: an engine and its KV pool, serving one role at a time (prefill or
decode, `services/duty.py`), which a `RoleChange` may switch at runtime without reloading
weights: the KV pool, the prefix cache and the transfer engine stay.

Lifecycle additions to `Service`: start() assembles the engine (`worker_parts`), starts it,
registers the worker in the registry bucket, announces its prefix cache (`kv_events`, then
at each heartbeat and after each prefill), starts its role's duty, subscribes to aborts
and role changes, and starts heartbeating. stop() first heartbeats `is_draining` (the
conductor sends no more work; the duty refuses new work but finishes what it holds), drains,
fails whatever is still held, closes the engine and removes the registry entry.

A role change (`RoleChange`, request/reply): the new role's duty starts (or, when its work
is still finishing there, takes work again) and the next heartbeat announces the new role;
the old duty stops taking work and finishes what it holds meanwhile (decode streams run to
their end, prefills hand their KV off), then stops. A switch never fails a request, and it
never waits for the old role's work: under a long prefill queue a decode worker's
reservations wait for that queue, and the switch is wanted exactly then.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections import Counter
from typing import ClassVar

from engine.protocol import Engine
from services.decode.duty import DecodeDuty
from services.duty import Duty
from services.heartbeat_sender import HeartbeatSender
from services.kv_events import KvEventPublisher
from services.kv_handoff import KvHandoff, NoKvHandoff
from services.kv_leases import LeaseTable
from services.model_shelf import config_for_model, models_on_disk
from services.prefill.duty import PrefillDuty
from services.prefill.prefix_reuse import PrefixSharing
from services.superseded import Superseded, placed_from
from services.worker_parts import assemble, model_files_dir, register_device_kv
from shared import tracing
from shared.config import WorkerConfig
from shared.errors import ConfigError
from shared.heartbeats import WorkerDirectory
from shared.messages import (
    AbortRequest,
    DispatchReply,
    KvLeaseEvent,
    RoleChange,
    WorkerHeartbeat,
    WorkerRole,
)
from shared.metrics import CounterAtScrape, ElasticWorkerMetrics
from shared.service import Service, ServiceState
from transfer_engine.engine import TransferEngine

ROLES: tuple[WorkerRole, ...] = ("prefill", "decode")  # RoleChange's own type checks it


class WorkerService(Service):
    """`halfmoon worker --role prefill|decode`: one worker, its role switchable at runtime."""

    name = "worker"
    metrics_type = ElasticWorkerMetrics
    metrics: ElasticWorkerMetrics
    duty_types: ClassVar[dict[WorkerRole, type[Duty]]] = {
        "prefill": PrefillDuty, "decode": DecodeDuty}

    def __init__(self, config: WorkerConfig, engine: Engine | None = None, *,
                 role: WorkerRole | None = None) -> None:
        super().__init__(config)
        self.config: WorkerConfig = config
        self._role: WorkerRole = role or config.role
        self._home_role = self._role  # the planner sends a worker it moved back here
        self.worker_id = config.worker_id or f"{self._role}-{uuid.uuid4().hex[:12]}"
        self.started_at_s = time.time()  # this process's (or reload's) start: see heartbeat
        self._engine = engine
        # Built once the parts are assembled: the role's duty, and a duty of the role left
        # last while it finishes its work.
        self._duties: dict[WorkerRole, Duty] = {}
        self._switching = asyncio.Lock()  # role changes and duties' retirements in turn
        self._is_engine_started = False
        self.kv_commits: Counter[str] = Counter()  # requests joined (decode), by KV transport
        # Assembled at start (`worker_parts`).
        self.transfer: TransferEngine | None = None  # for engines with a KV pool
        self.handoff: KvHandoff = NoKvHandoff()
        self.prefix_sharing: PrefixSharing | None = None
        # Every hold of KV blocks on behalf of another party (`kv_leases`).
        self.leases = LeaseTable(self.worker_id, self.metrics, self._publish_lease_event)
        # Requests placed again since: their earlier placements' late commands are refused.
        self.superseded = Superseded()
        self.heartbeats = HeartbeatSender(
            self.worker_id, self.subjects, config.heartbeat_interval_s, config.js_replicas,
            build=self.heartbeat, roles=lambda: dict.fromkeys([self.role, *self._duties]),
            nc=lambda: self.nc, spawn=self.spawn)
        self.kv_events = KvEventPublisher(
            self.worker_id, config.engine.block_size, self.subjects,
            cache=lambda: self.engine.prefix_cache, nc=lambda: self.nc, spawn=self.spawn,
            replicas=config.js_replicas)
        self._model_path = ""  # where the engine read the model, once started
        self._shelf: list[str] = []  # models it may switch to (`model_shelf`)
        self._model_load_s = 0.0
        # Set when a RoleChange gave it another model: the command, and what to run next.
        self._loading: RoleChange | None = None
        self.reload_as: WorkerConfig | None = None

    @property
    def instance_id(self) -> str:
        return self.worker_id

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError(f"{self.name} has no engine before start()")
        return self._engine

    @property
    def role(self) -> WorkerRole:
        return self._role

    @property
    def duty(self) -> Duty:
        """The duty of the role served now."""
        if self._role not in self._duties:
            raise RuntimeError(f"{self.name} has no duty before start()")
        return self._duties[self._role]

    @property
    def duties(self) -> list[Duty]:
        """The role's duty, and the last role's while its work finishes."""
        return list(self._duties.values())

    @property
    def is_draining(self) -> bool:
        """Taking no new work (stopping)."""
        return self._role in self._duties and self.duty.is_draining

    async def _setup(self) -> None:
        loading_since = time.monotonic()
        parts = await assemble(self.config, self.worker_id, self.nc, self.subjects,
                               self.metrics, self.leases, engine=self._engine)
        self._engine, self.handoff = parts.engine, parts.handoff
        self._model_path = model_files_dir(self.config.engine)
        self.transfer, self.prefix_sharing = parts.transfer, parts.prefix_sharing
        await self.engine.start()
        self._is_engine_started = True
        self._model_load_s = time.monotonic() - loading_since
        self._shelf = models_on_disk(self.config)
        await register_device_kv(parts)
        self._read_gauges_at_scrape()
        await self.heartbeats.open_registry()
        await self.kv_events.declare()
        await self.kv_events.publish()  # the whole cache: a reset
        self._duties[self._role] = self.duty_types[self._role](self)
        await self.duty.start()
        self._show_role()
        await self.serve(self.subjects.abort, AbortRequest, self._on_abort)
        await self.serve(self.subjects.role_change(self.worker_id), RoleChange,
                         self._on_role_change)
        await self.heartbeats.send()
        await self.heartbeats.registered()  # before start() returns
        self.spawn(self._heartbeat_loop(), "heartbeat")

    def _read_gauges_at_scrape(self) -> None:
        metrics, engine = self.metrics, self.engine
        metrics.running.set_function(lambda: engine.stats().num_running)
        metrics.waiting.set_function(self._num_waiting)
        metrics.kv_blocks_free.set_function(lambda: engine.stats().num_free_blocks)
        metrics.busy_seconds.set_function(lambda: engine.stats().busy_s)
        metrics.kv_blocks_used.set_function(
            lambda: (stats := engine.stats()).num_total_blocks - stats.num_free_blocks)
        metrics.registry.register(CounterAtScrape(
            "halfmoon_preemptions", "running requests whose KV blocks were taken for others "
            "(each is computed again, prompt and output so far, then decodes on)",
            lambda: engine.stats().num_preemptions))

    def _publish_lease_event(self, event: KvLeaseEvent) -> None:
        if self._nc is not None and not self._nc.is_closed:
            self.spawn(self.events.lease(event), f"lease.{event.request_id}")

    def _num_waiting(self) -> int:
        return sum(duty.num_waiting() for duty in self._duties.values())

    def _worker_views(self) -> list[WorkerDirectory]:
        return [view for duty in self._duties.values() for view in duty.worker_views()]

    async def _on_abort(self, message: AbortRequest) -> DispatchReply | None:
        if message.worker_id and message.worker_id != self.worker_id:
            return None  # one side of a re-placed request: another worker's to drop
        reaches = self.superseded.reaches(message)
        self.superseded.note(message)
        self.log.debug("request.abort", request_id=message.request_id, reason=message.reason,
                       attempt=message.attempt, before_delivery=message.before_delivery,
                       reaches=reaches)
        if reaches:  # else what it places again is here already: its command came first
            again = placed_from(message) if message.before_delivery > 0 else None
            for duty in list(self._duties.values()):
                duty.abort(message.request_id, placed_from=again)
        return None

    async def _on_role_change(self, command: RoleChange) -> DispatchReply:
        """One at a time (NATS runs a subscription's callbacks in order): a second change
        sent meanwhile is judged once the first is done."""
        if command.model and command.model != self.config.model:
            return self._change_model(command)
        if command.role == self._role:
            return self.accept()
        if self.state is not ServiceState.RUNNING or self.is_draining:
            return self.refusal(f"cannot change role while {self.state.value}")
        with tracing.span(__name__, "worker.role_change", attributes={
                "halfmoon.worker": self.worker_id, "halfmoon.from_role": self._role,
                "halfmoon.to_role": command.role, "halfmoon.reason": command.reason}):
            async with self._switching:
                old = self.duty
                new = self._duties.get(command.role)
                if new is None:
                    new = self.duty_types[command.role](self)
                    await new.start()
                    self._duties[command.role] = new
                else:  # its work was still finishing here: it takes work again
                    new.resume()
                old.stop_intake()
                self._role = command.role
            self.metrics.role_changes.labels(old.role, new.role).inc()
            self._show_role()
            await self.heartbeats.send()
            self.log.info("role.changed", from_role=old.role, to_role=new.role,
                          reason=command.reason, requested_by=command.requested_by,
                          is_old_role_idle=old.is_idle())
            self.spawn(self._retire(old), f"retire.{old.role}")
        return self.accept()

    def _change_model(self, command: RoleChange) -> DispatchReply:
        """Accept, then finish everything held and stop to reload as `command.model`."""
        if self.state is not ServiceState.RUNNING or self.is_draining:
            return self.refusal(f"cannot change model while {self.state.value}")
        try:
            config = config_for_model(self.config, self.worker_id, command.model, command.role)
        except ConfigError as exc:
            return self.refusal(exc.message)
        self._loading = command
        for duty in self._duties.values():
            duty.stop_intake()
        self.log.info("model.change", from_model=self.config.model, to_model=command.model,
                      role=command.role, reason=command.reason,
                      requested_by=command.requested_by)
        self.spawn(self._reload(config, command), "reload")
        return self.accept()

    async def _reload(self, config: WorkerConfig, command: RoleChange) -> None:
        with tracing.span(__name__, "worker.model_change", attributes={
                "halfmoon.worker": self.worker_id, "halfmoon.from_model": self.config.model,
                "halfmoon.to_model": command.model, "halfmoon.to_role": command.role,
                "halfmoon.reason": command.reason}):
            await self.heartbeats.send()  # draining: nothing new is sent here
            await self.wait_until(lambda: all(d.is_idle() for d in self._duties.values()),
                                  interval_s=0.05)
        self.metrics.model_changes.labels(self.config.model, command.model).inc()
        self.reload_as = config
        self.request_stop()

    async def _retire(self, duty: Duty) -> None:
        """Stop `duty` once it holds nothing, unless its role was taken up again."""
        started = time.monotonic()
        await self.wait_until(lambda: duty.is_idle() or not duty.is_draining, interval_s=0.05)
        async with self._switching:
            if not duty.is_draining or self._duties.get(duty.role) is not duty:
                return
            del self._duties[duty.role]
            await duty.stop()
        self.log.info("role.retired", role=duty.role,
                      finished_s=round(time.monotonic() - started, 3))

    def _show_role(self) -> None:
        for role in ROLES:
            self.metrics.role.labels(role).set(1 if role == self._role else 0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._sleep_judging_on_time(self.config.heartbeat_interval_s)
            for duty in list(self._duties.values()):
                duty.on_tick()
            self.kv_events.publish_soon()  # never holds up the heartbeat
            await self.heartbeats.send()

    def heartbeat(self) -> WorkerHeartbeat:
        stats = self.engine.stats()
        return WorkerHeartbeat(
            worker_id=self.worker_id, role=self.role, model=self.config.model,
            host=self.config.host_name or socket.gethostname(),
            num_running=stats.num_running, num_waiting=self._num_waiting(),
            max_batch_size=stats.max_batch_size, num_free_blocks=stats.num_free_blocks,
            num_total_blocks=stats.num_total_blocks, block_size=self.config.engine.block_size,
            heartbeat_interval_s=self.config.heartbeat_interval_s, sent_at_s=time.time(),
            is_draining=self.is_draining, compute_score=self.config.compute_score,
            zone=self.config.zone, prefill_tokens_per_s=stats.prefill_tokens_per_s,
            num_waiting_tokens=stats.num_waiting_tokens, decode_step_s=stats.decode_step_s,
            max_queue=self.config.max_queue, prefill_overhead_s=stats.prefill_overhead_s,
            prefill_s_per_token=stats.prefill_s_per_token,
            prefill_fit_age_s=stats.prefill_fit_age_s,
            decode_overhead_s=stats.decode_overhead_s,
            decode_s_per_sequence=stats.decode_s_per_sequence,
            local_prefill_max_tokens=self.config.local_prefill_max_tokens
            if self.role == "decode" else 0,
            kv_bytes_per_block=layout.block_bytes
            if (layout := self.engine.kv_layout()) is not None else 0,
            busy_s=stats.busy_s, home_role=self._home_role,
            model_path=self._model_path, models_on_disk=self._shelf,
            model_load_s=self._model_load_s,
            loading_model=self._loading.model if self._loading is not None else "",
            loading_role=self._loading.role if self._loading is not None else None,
            started_at_s=self.started_at_s, max_model_len=stats.max_model_len,
            kv_blocks_by_priority=stats.blocks_by_priority,
            num_waiting_tokens_by_priority=stats.waiting_tokens_by_priority,
        )

    async def _stop_intake(self) -> None:
        for duty in self._duties.values():
            duty.stop_intake()
        await self.heartbeats.send()

    async def _drain(self) -> None:
        await self.wait_until(lambda: all(d.is_idle() for d in self._duties.values()))

    async def _close(self) -> None:
        for duty in list(self._duties.values()):
            await duty.close()
            await duty.stop()
        await self.handoff.close()
        if self._is_engine_started:
            await self.engine.close()
        if self.transfer is not None:
            await self.transfer.close()
        await self.heartbeats.deregister()


class PrefillService(WorkerService):
    """`halfmoon prefill`: a worker that starts as prefill."""

    name = "prefill"

    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        super().__init__(config, engine, role="prefill")


class DecodeService(WorkerService):
    """`halfmoon decode`: a worker that starts as decode."""

    name = "decode"

    def __init__(self, config: WorkerConfig, engine: Engine | None = None) -> None:
        super().__init__(config, engine, role="decode")
