"""The conductor: takes requests off the JetStream work queue and places them.

Replicas share one durable pull consumer (`intake`), so each request is placed once. Per
request: pick a prefill and a decode worker from live heartbeats (or one decode worker that
prefills it itself), send their commands at the same time, and ack the request once every
side accepted (`placer`, over the pure decisions of `assignment`, `placement`,
`cost_model`). When one side refuses or is gone, only that side is placed again (up to
`max_placement_attempts`), the accepted side is kept; when placement is impossible the
gateway gets `RequestFailed` (429 for capacity, 503 for no workers) and any accepted side is
aborted; a request for a model no worker of a role serves is held while one loads it
(`model_loader`), one that finds no room (a healthy worker of a role, decode KV, a prefill
queue) waits in its model's line (`room_lines`), one its gateway ended meanwhile (the
client gone) is dropped (`abandoned`), and what the conductor sends goes through its
`outbox`. A request JetStream delivers again may have been placed already: its gateway
is asked first (`redelivery`). A decode side lost after prefill is replaced with the KV kept
(`decode_replacement`). The global prefix index follows the workers' KV events
(`prefix_follower`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from opentelemetry.trace import Span

from services.conductor import assignment, holding, redelivery
from services.conductor.abandoned import Abandoned
from services.conductor.decode_replacement import DecodeReplacer
from services.conductor.intake import InHand, RequestIntake
from services.conductor.model_loader import ModelLoader
from services.conductor.outbox import Outbox
from services.conductor.placer import Lapsed, Placer
from services.conductor.planning import PlanningLoop
from services.conductor.prefix_follower import STREAM_CHECK_S, PrefixIndexFollower
from services.conductor.prefix_index import PrefixIndex
from services.conductor.room_lines import RoomLines, Waiter
from shared import tracing
from shared.config import ConductorConfig
from shared.errors import HalfmoonError, RequestAborted, Shortage, SloViolation
from shared.heartbeats import WorkerDirectory
from shared.jetstream_assets import read_registry
from shared.messages import (
    AbortRequest,
    DecodeReplacement,
    GenerateRequest,
    WorkerHeartbeat,
    request_failed,
)
from shared.metrics import ConductorMetrics
from shared.service import Service

_request_decoder = msgspec.json.Decoder(GenerateRequest)


class ConductorService(Service):
    name = "conductor"
    metrics_type = ConductorMetrics
    metrics: ConductorMetrics

    def __init__(self, config: ConductorConfig) -> None:
        super().__init__(config)
        self.config: ConductorConfig = config
        self.prefix_index = PrefixIndex(config.prefix_index_max_blocks)
        self.workers = WorkerDirectory(config.heartbeat_timeout_s,
                                       on_expire=self.prefix_index.forget_worker)
        self.rejections: Counter[str] = Counter()  # by reason (also in the metrics)
        self.intake: RequestIntake | None = None
        self.prefix_follower: PrefixIndexFollower | None = None
        self.planning: PlanningLoop | None = None  # --planner slo
        self.outbox = Outbox(self, self.metrics, config.dispatch_timeout_s)
        self.model_loader = ModelLoader(self.subjects, self.workers, config, self.instance_id,
                                        self.outbox.dispatch, self.spawn)
        self.placer = Placer(config, self.subjects, self.workers, self.prefix_index,
                             self.model_loader, self.metrics, self.outbox.dispatch,
                             self.outbox.abort)
        self.room_lines = RoomLines()  # requests waiting for room, by model
        self.abandoned = Abandoned(self.room_lines, self.metrics.abandoned)
        self.decode_replacer = DecodeReplacer(self.workers, self.placer, self.outbox,
                                              self.abandoned, self.instance_id)
        self.redeliveries = redelivery.Redeliveries(self.metrics, self.outbox.abort,
                                                    self.outbox.tell_gateway)
        # Gauges read at scrape time, not kept up to date on every heartbeat.
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(role).set_function(
                lambda role=role: len(self.workers.healthy(role)))
        self.metrics.prefix_index_blocks.set_function(lambda: len(self.prefix_index))
        self.metrics.room_waiting.set_function(lambda: len(self.room_lines))

    async def _setup(self) -> None:
        await self.serve(self.subjects.all_heartbeats, WorkerHeartbeat, self._on_heartbeat)
        await self.serve(self.subjects.abort, AbortRequest, self.abandoned.on_abort)
        await self.serve(self.subjects.decode_replacement, DecodeReplacement,
                         self.decode_replacer.replace, queue=self.subjects.conductor_consumer)
        for heartbeat in await read_registry(self.nc.jetstream(), self.subjects.workers_bucket):
            self.workers.observe_entry(heartbeat)
        js = self.nc.jetstream()
        self.prefix_follower = PrefixIndexFollower(js, self.subjects, self.prefix_index,
                                                   replicas=self.config.js_replicas)
        await self.prefix_follower.start(self.config.prefix_catch_up_timeout_s)
        self.spawn(self.prefix_follower.keep_following(STREAM_CHECK_S), "prefix-stream")
        if self.config.prefix_snapshot_interval_s > 0:
            self.spawn(self.prefix_follower.save_every(self.config.prefix_snapshot_interval_s),
                       "prefix-snapshots")
        if self.config.planning.mode == "slo":
            self.planning = PlanningLoop(self.config, self.nc, self.subjects, self.workers,
                                         self.metrics, f"conductor-{uuid.uuid4().hex[:8]}",
                                         self.spawn)
            self.spawn(self.planning.run(), "planner")
        self.intake = RequestIntake(js, self.subjects, self._handle,
                                    max_age_s=self.config.request_max_age_s,
                                    replicas=self.config.js_replicas)
        await self.intake.start(self.config.num_fetchers, self.spawn)

    async def _on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self.workers.observe(heartbeat)
        self.placer.observe(heartbeat)
        self.model_loader.observe(heartbeat)
        for line in holding.lines_of(heartbeat.model):  # it may be back, or have room now
            self.room_lines.wake_head(line)

    async def _handle(self, msg: Msg, in_hand: InHand) -> None:
        """Error boundary: decode -> place -> ack; invalid -> term; unexpected -> nak; held
        past its ack wait -> nothing more (its delivery again decides); no room (no
        healthy worker of a role, no KV, full queues) -> in its model's line (`room_lines`),
        the delivery kept in hand."""
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            self.log.warning("request.invalid", error=str(exc))
            await msg.term()
            return
        if (age_s := holding.age_s(request, msg)) > holding.wait_of(request, self.config):
            self.log.warning("request.expired", request_id=request.request_id, age_s=age_s)
            await msg.ack()
            return
        if request.request_id in self.abandoned:
            await self.abandoned.drop(request, msg)
            return
        try:
            if msg.metadata.num_delivered > 1 and not await self.redeliveries.may_place(
                    self.nc, request, msg, in_hand.is_lapsed):
                return
        except Lapsed:
            self._let_go(request)
            return
        except Exception as exc:
            self.log.error("request.place_failed", request_id=request.request_id, exc_info=exc)
            await msg.nak(delay=0.5)
            return
        schedule = tracing.continued(__name__, "conductor.schedule",
                                     parent=tracing.extract(msg.headers), attributes={
                                         "halfmoon.request_id": request.request_id,
                                         "halfmoon.policy": self.config.policy,
                                         **redelivery.span_attributes(request, msg)})
        # A model with requests waiting for room (as urgent as this one, or more): the room
        # that frees is theirs first.
        line, hold_s = request.model, holding.shortage_hold_s(
            self.config, self.placer.rules.slo.ttft_s, holding.wait_of(request, self.config))
        if not self.room_lines.has_line(request.model, request.priority):
            if (waits := await self._place(request, msg, in_hand, schedule)) is None:
                if schedule is not None:
                    schedule.end()
                return
            line, hold_s = waits
        in_hand.keep()
        self.metrics.room_waits.inc()
        waiter = self.room_lines.join(line, request.request_id, request.priority,
                                      arrived_s=time.time() - holding.age_s(request, msg))
        self.spawn(self._wait_for_room(request, msg, in_hand, waiter, schedule, hold_s),
                   "room-line")

    async def _place(self, request: GenerateRequest, msg: Msg, in_hand: InHand,
                     schedule: Span | None) -> tuple[str, float] | None:
        """Place the delivery and settle it: ack; on failure hold it (nak) or refuse it;
        None. When it found no room (a healthy worker of a role, decode KV, a prefill
        queue) and may wait for some: the line to wait in and its hold (seconds from its
        creation), nothing settled."""
        progress = assignment.Progress(delivery=msg.metadata.num_delivered)
        try:
            with tracing.within(schedule), \
                    structlog.contextvars.bound_contextvars(request_id=request.request_id):
                chosen = await self.placer.place(request, progress,
                                                 is_current=lambda: not in_hand.is_lapsed())
            if in_hand.is_lapsed():  # its commands went out in time, not the gateway's word
                raise Lapsed
            await self.outbox.announce(request, chosen, time.perf_counter() - in_hand.taken_at,
                                       delivery=msg.metadata.num_delivered)
        except Lapsed:
            self._let_go(request)
            return None
        except RequestAborted as exc:  # a worker heard its gateway end it before we did
            for worker_id in set(progress.kept.values()):  # sides that took it meanwhile
                await self.outbox.abort(request.request_id, exc.message, worker_id,
                                        attempt=request.attempt)
            await self.abandoned.drop(request, msg, schedule)
            return None
        except HalfmoonError as exc:
            return await self._unplaced(request, msg, in_hand, progress, exc, schedule)
        except Exception as exc:
            tracing.failed(schedule, exc)
            self.log.error("request.place_failed", request_id=request.request_id, exc_info=exc)
            await msg.nak(delay=0.5)
            return None
        await msg.ack()
        return None

    async def _unplaced(self, request: GenerateRequest, msg: Msg, in_hand: InHand,
                        progress: assignment.Progress, exc: HalfmoonError,
                        schedule: Span | None) -> tuple[str, float] | None:
        """A delivery placement failed on: its line and hold when it may wait in this
        delivery for room or a worker; else held for a later delivery (nak) or refused."""
        if in_hand.is_lapsed():  # its abort, hold or refusal is the next delivery's
            self._let_go(request)
            return None
        age_s = holding.age_s(request, msg)
        ttft_slo_s = self.placer.rules.slo.ttft_s
        wait_s = holding.wait_of(request, self.config)
        hold_s = holding.hold_s(exc, self.config, ttft_slo_s, wait_s)
        # Short of room or of a worker, it waits to try again in this delivery: the sides
        # that accepted drop it. Not when a side was given up (a command unanswered, on
        # its way): that worker refuses the rest of this delivery, so the next one waits.
        if holding.waits_in_line(exc) and not self.room_lines.is_closed and \
                age_s < hold_s and not progress.num_given_up:
            for worker_id in set(progress.kept.values()):
                await self.outbox.abort(request.request_id, exc.message, worker_id,
                                        attempt=request.attempt)
            if schedule is not None:
                schedule.add_event("no_room" if isinstance(exc, Shortage) else "no_worker",
                                   {"halfmoon.reason": exc.message})
            return holding.line_of(request.model, exc), hold_s
        # Whatever it sent is dropped, and refused until its next delivery.
        if progress.num_sent:
            await self.outbox.abort(request.request_id, exc.message,
                                    attempt=request.attempt,
                                    before_delivery=msg.metadata.num_delivered + 1)
        tracing.failed(schedule, exc)
        delay_s = holding.retry_delay_s(exc, self.config, ttft_slo_s, wait_s=wait_s,
                                        age_s=age_s, num_delivered=msg.metadata.num_delivered)
        if delay_s is not None:
            self.log.info("request.held", reason=exc.message)
            self.redeliveries.held.note(request.request_id)
            await msg.nak(delay=delay_s)  # JetStream delivers it again then
            return None
        await self._reject(request, exc)
        await msg.ack()
        return None

    async def _wait_for_room(self, request: GenerateRequest, msg: Msg, in_hand: InHand,
                             waiter: Waiter, schedule: Span | None, hold_s: float) -> None:
        """In its line until placed or settled otherwise (refused once its hold,
        which each try renews for what it found missing, is spent); handed back to the
        queue if the conductor stops first."""
        async def try_again() -> bool:
            nonlocal hold_s
            if in_hand.is_lapsed():
                self._let_go(request)
                return True
            if request.request_id in self.abandoned:
                await self.abandoned.drop(request, msg, schedule)
                return True
            if (waits := await self._place(request, msg, in_hand, schedule)) is None:
                return True
            line, hold_s = waits  # for what this try found missing: its line, its hold
            self.room_lines.move(waiter, line)
            return False

        try:
            if not await self.room_lines.wait(
                    waiter, lambda: hold_s - holding.age_s(request, msg), try_again):
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()  # another conductor, or this one back, places it
        finally:
            in_hand.stop()
            if schedule is not None:
                schedule.end()

    def _let_go(self, request: GenerateRequest) -> None:
        """A delivery that lapsed while this conductor placed it (`InHand.is_lapsed`):
        another conductor may hold it again, and asks the gateway and aborts what this one
        sent before it places (`redelivery`). Nothing more is sent for it; neither ack nor
        nak."""
        self.log.warning("request.delivery_lapsed", request_id=request.request_id)
        self.metrics.deliveries_lapsed.inc()

    async def _reject(self, request: GenerateRequest, error: HalfmoonError) -> None:
        self.log.info("request.rejected", request_id=request.request_id, code=error.code,
                      reason=error.message)
        reason = "slo" if isinstance(error, SloViolation) else error.code.value
        self.rejections[reason] += 1
        if isinstance(error, SloViolation) and self.planning is not None:
            self.planning.slo_rejections.note(request.model, error.role, time.monotonic())
        self.metrics.rejections.labels(reason).inc()
        await self.outbox.tell_gateway(request, request_failed(request.request_id, error,
                                                               self.instance_id))

    def _worker_views(self) -> list[WorkerDirectory]:
        return [self.workers]

    async def _stop_intake(self) -> None:
        if self.intake is not None:
            self.intake.stop()
        self.room_lines.close()

    async def _drain(self) -> None:
        await self.wait_until(lambda: (self.intake is None or self.intake.num_in_hand == 0)
                              and not self.room_lines)

    async def _close(self) -> None:
        if self.intake is not None:
            await self.intake.close()
        if self.prefix_follower is not None:
            with contextlib.suppress(Exception):
                await self.prefix_follower.stop()
