"""The decode role of a worker: reserves KV blocks, joins committed requests, streams tokens.

A request's life here:
  1. `DecodeReservation` (request/reply): reserve blocks (the torch engine takes the
     prompt's and a block of headroom; the rest as the request grows), send the
     `KvTarget` to the named prefill worker, accept. A repeated reservation (the conductor
     re-placed prefill) keeps the blocks and re-sends the target to the new prefill worker,
     also while draining: it is not new work, and refused it would leave the new prefill
     worker waiting for a target that never comes.
     What the request needs beyond blocks (a grammar, compiled) is readied meanwhile, off
     the reply's path: the conductor waits on the reply, and a first compile takes seconds.
  2. `KvCommitted` (request/reply): the KV is in; join the running batch (once readied).
  3. Each engine step yields one token per running request; they go out as one `TokenBatch`
     per gateway per step (several where one would pass NATS' payload limit:
     `shared.token_batches`). Finished requests leave the batch and free their blocks.
  4. `StreamResume` (from a gateway whose stream stalled, e.g. across a NATS restart): the
     tokens sent since the index it names go out again (`stream_resume`, `sent_tokens`).
  5. `ShedLoad` (from the planner, when this worker runs more than its share while others
     have room): the running requests with the most tokens still owed leave here; each
     one's gateway hears `moved` after every token sent, and places the rest anew.
  6. Every few seconds, the gateways are asked which running requests a client still
     waits for (`orphans`); the others are aborted.
A reservation is a KV lease (`kv_leases`) held for the prefill worker, which renews it every
heartbeat while the request is queued or computing there; one not renewed for
`kv_wait_timeout_s` expires, its blocks are freed and the request fails. An abort frees the
request at whatever step it is.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from engine.protocol import DecodeRequest, PrefillRequest, TokenOutput
from services.decode import orphans
from services.decode.held_requests import HeldRequests, Reservation
from services.decode.orphans import OrphanFinder
from services.decode.sent_tokens import SentTokens
from services.decode.spans import DecodeSpans
from services.decode.stream_resume import StreamResumes
from services.duty import Duty, Handler
from services.kv_leases import Lease
from services.superseded import Mark
from shared.errors import (
    CapacityExhausted,
    HalfmoonError,
    InvalidRequest,
    RequestAborted,
    RequestMoved,
    TransferTimeout,
)
from shared.heartbeats import WorkerDirectory
from shared.messages import (
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    KvCommitted,
    KvLeaseRenewal,
    KvTarget,
    ShedLoad,
    StreamResume,
    TokenDelta,
    TokenLogprob,
    WorkerHeartbeat,
    choice_id,
    request_failed,
)
from shared.nats_client import encode
from shared.token_batches import encoded_batches

if TYPE_CHECKING:
    from services.worker import WorkerService

# How long a finished request's tokens stay, to be sent again if its last batch was lost.
RESEND_KEEP_S = 30.0


class DecodeDuty(Duty):
    """The decode role: reservations from conductors, commits from prefill, the step loop."""

    role = "decode"

    def __init__(self, worker: WorkerService) -> None:
        super().__init__(worker)
        self._held = HeldRequests()
        self._taking: dict[str, bool] = {}  # taking blocks from less urgent ones: aborted?
        self._spans = DecodeSpans()
        self._sent = SentTokens(keep_s=RESEND_KEEP_S)
        # Prefill workers' liveness: a reservation held for a dead one is freed at once.
        self._prefills = WorkerDirectory(timeout_s=4 * self.config.heartbeat_interval_s)
        self._resumes = StreamResumes(self.nc, self.worker_id, worker.started_at_s,
                                      self._held, self._sent, self._prefills, self.log)
        self._last_step_at: float | None = None
        # Held while a step's tokens go out: a shed request's `moved` follows its last batch.
        self._publishing = asyncio.Lock()

    def _handlers(self) -> list[Handler]:
        s, me = self.subjects, self.worker_id
        return [(s.decode_reserve(me), DecodeReservation, self._on_reserve),
                (s.kv_commit(me), KvCommitted, self._on_commit),
                (s.stream_resume(me), StreamResume, self._resumes.answer),
                (s.kv_lease_renewal(me), KvLeaseRenewal, self._on_lease_renewal),
                (s.role_heartbeats("prefill"), WorkerHeartbeat, self._on_prefill_heartbeat),
                (s.shed_load(me), ShedLoad, self._on_shed)]

    async def start(self) -> None:
        await super().start()
        self.run_loop(self._step_loop(), "steps")
        self.run_loop(self._let_orphans_go(), "orphans")

    @property
    def num_open_requests(self) -> int:
        return self._held.num_open

    def num_waiting(self) -> int:
        return self._held.num_waiting()

    async def _on_reserve(self, message: DecodeReservation) -> DispatchReply:
        request, marks = message.request, self.worker.superseded
        if (stale := self.refusal_if_stale(request, message.delivery)) is not None:
            return stale
        # A reservation is re-pointed; an earlier delivery's run stops: its abort is on its way.
        if marks.replaces(request, message.delivery) \
                and request.request_id not in self._held.reservations:
            self.abort(request.request_id)
        if (held := self._held.attempt(request.request_id)) is not None \
                and held < request.attempt:  # the gateway's abort of it was lost
            return self.worker.refusal(f"attempt {held} of the request still runs here")
        reservation = self._held.reservations.get(request.request_id)
        if self.is_draining and reservation is None:  # one it holds may still be re-pointed
            return self.worker.refusal("worker is draining")
        try:
            self.engine.check(request.sampling)
        except InvalidRequest as exc:  # the client's to fix: a 400, not a retry elsewhere
            await self._fail(request, exc)
            return self.worker.refusal(exc.message)
        if message.is_local_prefill:
            marks.placed(request.request_id, request.attempt, message.delivery)
            return self._prefill_here(request)
        if reservation is None:
            if (block_ids := await self._reserve(request)) is None:
                return self.worker.refusal("aborted while blocks were taken for it")
            reservation = Reservation(request, message.prefill_worker_id, block_ids,
                                      self._readying(request))
            self._held.reservations[request.request_id] = reservation
        reservation.prefill_worker_id = message.prefill_worker_id
        marks.placed(request.request_id, request.attempt, message.delivery)
        self.log.debug("decode.reserved", request_id=request.request_id,
                       attempt=request.attempt, delivery=message.delivery,
                       prefill_worker_id=message.prefill_worker_id)
        self.leases.grant("decode_reservation", request.request_id, message.prefill_worker_id,
                          len(reservation.block_ids), self.config.transfer.kv_wait_timeout_s)
        layout, transfer = self.engine.kv_layout(), self.worker.transfer
        target = KvTarget(request_id=request.request_id, decode_worker_id=self.worker_id,
                          block_ids=reservation.block_ids,
                          kv_num_blocks=layout.num_blocks if layout else 0,
                          kv_block_bytes=layout.layer_block_bytes if layout else 0,
                          kv_layout=layout,
                          engine_incarnation=transfer.incarnation if transfer else "",
                          attempt=request.attempt, delivery=message.delivery)
        await self.nc.publish(self.subjects.kv_target(message.prefill_worker_id), encode(target))
        return self.worker.accept()

    async def _reserve(self, request: GenerateRequest) -> list[int] | None:
        """Blocks for the request: at once; or, the pool short, those of running requests
        less urgent than it, preempted (in the engine thread, between steps: the one wait
        here). None when it was aborted meanwhile (its blocks are given back)."""
        num_prompt = len(request.prompt_token_ids)
        request_id, num_tokens = request.request_id, num_prompt + request.sampling.max_tokens
        try:
            return self.engine.reserve(request_id, num_tokens, num_choices=request.sampling.n,
                                       num_prompt_tokens=num_prompt)
        except CapacityExhausted:
            if request.priority >= max(self.engine.stats().blocks_by_priority,
                                      default=request.priority):
                raise  # nothing running is less urgent
        self._taking[request_id] = False
        try:
            block_ids = await self.engine.reserve_over(
                request_id, num_tokens, priority=request.priority,
                num_choices=request.sampling.n, num_prompt_tokens=num_prompt)
        finally:
            is_aborted = self._taking.pop(request_id)
        if is_aborted:
            self.engine.abort(request_id)
            return None
        return block_ids

    def _readying(self, request: GenerateRequest) -> asyncio.Task[InvalidRequest | None]:
        return self.worker.spawn(self._ready(request), f"ready.{request.request_id}")

    async def _ready(self, request: GenerateRequest) -> InvalidRequest | None:
        """Ready what the request needs beyond blocks; why it cannot be, if so."""
        try:
            await self.engine.prepare(request.sampling)
        except InvalidRequest as exc:
            return exc
        return None

    async def _when_ready(self, request: GenerateRequest,
                          readied: Awaitable[InvalidRequest | None],
                          is_still_wanted: Callable[[], bool], then: Callable[[], None]) -> None:
        """`then()` once the request is readied, unless aborted meanwhile; a request that
        cannot be readied or started is failed (a 400 for the client) and freed."""
        error = await readied
        if not is_still_wanted():
            return
        try:
            if error is not None:
                raise error
            then()
        except HalfmoonError as exc:
            self.abort(request.request_id)
            await self._fail(request, exc)

    def _prefill_here(self, request: GenerateRequest) -> DispatchReply:
        """Colocated: the engine prefills and decodes; every token comes from the step loop."""
        request_id, held = request.request_id, self._held
        if request_id in held.active or request_id in held.choices or request_id in held.local:
            return self.worker.accept()
        self._held.local[request_id] = request

        def generate() -> None:
            del self._held.local[request_id]
            self.engine.generate(PrefillRequest(request_id, request.prompt_token_ids,
                                                request.sampling,
                                                output_offset=request.output_offset,
                                                priority=request.priority))
            self._open_choices(request, [], [], [])
            self._count_commit("local")

        self.worker.spawn(self._when_ready(request, self._ready(request),
                                           lambda: self._held.local.get(request_id) is request,
                                           generate), f"local.{request_id}")
        return self.worker.accept()

    def _open_choices(self, request: GenerateRequest, first_tokens: list[int],
                      first_logprobs: list[TokenLogprob | None], finished: list[int],
                      lease: Lease | None = None) -> None:
        """Follow each choice still open under its own id (the request's own for n = 1),
        with the tokens it has already (prefill's first ones)."""
        n = request.sampling.n
        choices = []
        for choice in range(n):
            if choice in finished:
                continue
            one = request if n == 1 else msgspec.structs.replace(
                request, request_id=choice_id(request.request_id, choice, n))
            choices.append(one.request_id)
            self._held.active[one.request_id] = one
            self._sent.open(one, first_tokens[choice:choice + 1],
                            first_logprobs[choice:choice + 1])
            self._spans.start(one.request_id, self.worker_id, lease)
        if n > 1:
            self._held.choices[request.request_id] = choices

    def _count_commit(self, transport: str) -> None:
        self.worker.kv_commits[transport] += 1
        self.metrics.kv_commits.labels(transport).inc()

    async def _on_commit(self, message: KvCommitted) -> DispatchReply:
        reservation = self._held.reservations.get(message.request_id)
        if reservation is None:  # the prefill worker may not have heard of an end yet
            return self.refusal_if_ended(message.request_id) or \
                self.worker.refusal(f"no reservation for {message.request_id}")
        if reservation.commit is not None:
            return self.worker.accept()  # a repeated commit (its first reply was lost)
        reservation.commit = message
        lease = self.leases.release("decode_reservation", message.request_id)
        self._count_commit(message.transport)
        self.log.debug("decode.kv_committed", request_id=message.request_id,
                       prefill_worker_id=message.prefill_worker_id,
                       kv_bytes=message.num_kv_bytes, transport=message.transport)
        if reservation.readied.done() and reservation.readied.result() is None:
            self._join(reservation, message, lease)
        else:  # the grammar still compiles (or cannot be): join when it is done
            self.worker.spawn(self._when_ready(
                reservation.request, reservation.readied,
                lambda: self._held.reservations.get(message.request_id) is reservation,
                lambda: self._join(reservation, message, lease)), f"join.{message.request_id}")
        return self.worker.accept()

    def _join(self, reservation: Reservation, message: KvCommitted, lease: Lease | None) -> None:
        request = reservation.request
        del self._held.reservations[request.request_id]
        # No KV crossed (the handoff had nothing to move it with): recompute the prompt here.
        self.engine.join(DecodeRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            first_token_id=message.first_token_id, sampling=request.sampling,
            is_kv_ready=message.transport != "none", output_offset=request.output_offset,
            first_token_ids=message.first_token_ids,
            finished_choices=message.finished_choices, priority=request.priority,
        ))
        first_tokens = message.first_token_ids or [message.first_token_id]
        first_logprobs: list[TokenLogprob | None] = (
            list(message.first_logprobs) or [message.first_logprob])
        self._open_choices(request, first_tokens, first_logprobs, message.finished_choices,
                           lease)

    async def _step_loop(self) -> None:
        while True:
            outputs = await self.engine.next_step()
            now = time.perf_counter()
            if self._last_step_at is not None and outputs:
                self.metrics.step_seconds.observe(now - self._last_step_at)
            # Consecutive steps only: an idle engine's wait is not a step.
            self._last_step_at = now if self._held.active else None
            self.metrics.generated_tokens.inc(len(outputs))
            await self._publish_step(outputs)

    async def _publish_step(self, outputs: list[TokenOutput]) -> None:
        by_gateway: dict[str, list[TokenDelta]] = defaultdict(list)
        for output in outputs:
            request = self._held.active.get(output.request_id)
            if request is None:
                continue  # aborted while the step ran
            if output.error is not None:
                del self._held.active[output.request_id]
                self._sent.drop(output.request_id)
                self._spans.end(output.request_id, error=output.error.message)
                await self._fail(request, output.error)
                continue
            self._spans.step(output)
            wants_logprobs = request.sampling.logprobs is not None and output.logprob is not None
            self._sent.record(output.request_id, output.token_id, output.finish_reason,
                              output.logprob if wants_logprobs else None)
            by_gateway[request.reply_subject].append(TokenDelta(
                request_id=output.request_id, index=request.output_offset + output.index,
                token_ids=[output.token_id],
                finish_reason=output.finish_reason,
                num_cached_tokens=output.num_cached_tokens,
                logprobs=[output.logprob] if wants_logprobs else None,  # type: ignore[list-item]
                prompt_logprobs=output.prompt_logprobs,
            ))
            if output.finish_reason is not None:
                del self._held.active[output.request_id]
        async with self._publishing:
            for subject, items in by_gateway.items():
                for batch in encoded_batches(self.worker_id, items, self.nc.max_payload):
                    await self.nc.publish(subject, batch)

    async def _fail(self, request: GenerateRequest, error: HalfmoonError) -> None:
        failure = request_failed(request.request_id, error, self.worker_id)
        await self.nc.publish(request.reply_subject, encode(failure))

    async def _on_shed(self, message: ShedLoad) -> DispatchReply:
        """Hand back up to `num_requests` running requests (single-choice ones), those with
        the most tokens still owed: they gain most from a less loaded worker."""
        owed = sorted(((request.sampling.max_tokens - self._sent.num_sent(request_id),
                        request_id) for request_id, request in self._held.active.items()
                       if request.sampling.n == 1), reverse=True)
        shed = [self._held.active[request_id] for _, request_id in owed[:message.num_requests]]
        for request in shed:
            self._spans.end(request.request_id)  # moved on, not failed
            self.abort(request.request_id)
        error = RequestMoved(f"decode worker {self.worker_id} shed its load: "
                             f"{message.reason or 'asked to'}")
        async with self._publishing:  # after the last batch with their tokens
            for request in shed:
                await self._fail(request, error)
        self.metrics.shed_requests.inc(len(shed))
        self.log.info("decode.shed", num_requests=len(shed), asked=message.num_requests,
                      reason=message.reason, requested_by=message.requested_by)
        return DispatchReply(is_accepted=True, worker_id=self.worker_id,
                             reason=f"handed back {len(shed)}")

    async def _on_prefill_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self._prefills.observe(heartbeat)

    async def _on_lease_renewal(self, message: KvLeaseRenewal) -> None:
        """The prefill worker still queues or computes these requests: keep their blocks."""
        for request_id in message.request_ids:
            self.leases.renew("decode_reservation", request_id, message.prefill_worker_id,
                              self.config.transfer.kv_wait_timeout_s)

    def abort(self, request_id: str, *, placed_from: Mark | None = None) -> None:
        for stream_id in self._held.drop(request_id):
            self._sent.drop(stream_id)
            self._spans.abort(stream_id)
        if request_id in self._taking:
            self._taking[request_id] = True
        self.leases.release("decode_reservation", request_id)
        self.engine.abort(request_id)

    async def _let_orphans_go(self) -> None:
        """Every `orphans.CHECK_EVERY_S`: abort what this worker decodes for no one."""
        finder = OrphanFinder(self.nc)
        while True:
            await asyncio.sleep(orphans.CHECK_EVERY_S)
            asked = dict(self._held.active)
            for request_id in await finder.find(asked.values()):
                if self._held.active.get(request_id) is asked[request_id]:  # not ended meanwhile
                    self.log.warning("request.orphaned", request_id=request_id)
                    self.metrics.orphaned_streams.inc()
                    self.abort(request_id)

    def on_tick(self) -> None:
        self._sent.expire()
        for lease in self.leases.expired(("decode_reservation",),
                                         is_party_lost=self._prefills.is_lost):
            reservation = self._held.reservations.get(lease.request_id)
            if reservation is None:
                continue
            is_lost = self._prefills.is_lost(lease.party)
            self.log.warning("kv_lease.expired", kind=lease.kind, request_id=lease.request_id,
                             prefill_worker_id=lease.party, blocks_freed=lease.num_blocks,
                             reason="prefill worker lost" if is_lost else "not renewed")
            self.abort(lease.request_id)
            if is_lost:
                continue  # the gateway places the request again itself (it saw the loss too)
            # The client may hold a first token already: tell it the rest is not coming.
            error = TransferTimeout(f"the KV from prefill worker {lease.party} never arrived "
                                    "and it stopped renewing the reservation")
            self.worker.spawn(self._fail(reservation.request, error),
                              f"expire.{lease.request_id}")

    def worker_views(self) -> list[WorkerDirectory]:
        return [self._prefills]

    def is_idle(self) -> bool:
        return self.num_open_requests == 0

    async def close(self) -> None:
        # Whatever is still open after the drain is failed loudly, never left hanging.
        for request in self._held.requests():
            self.abort(request.request_id)
            if not self.nc.is_closed:
                await self._fail(request, RequestAborted("decode worker stopped"))
