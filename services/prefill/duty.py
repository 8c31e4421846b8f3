"""The prefill role of a worker: computes prompts, sends first tokens, hands KV to decode.

A request's life here:
  1. `PrefillTask` arrives (request/reply): accepted at once unless the queue is full. When
     it names a `prefix_source`, the cached prefix this worker lacks is fetched from there
     first (`prefix_reuse`).
  2. A KV stream opens and the engine prefills (batched with whatever else waits). As each
     layer of the prompt completes, the stream writes its K/V blocks into the blocks named by
     the decode worker's `KvTarget` (sent by decode while we compute).
  3. The first token goes straight to the gateway (this is TTFT).
  4. The stream finishes: the last layer is at decode.
  5. `KvCommitted` (request/reply) tells decode to join the request to its batch.
  6. The engine releases the request's KV.
Any failure sends `RequestFailed` to the gateway and an `AbortRequest` so decode frees its
reservation. An abort cancels the request at whatever step it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import TYPE_CHECKING, NamedTuple

import nats.errors
import structlog

from engine.protocol import PrefillRequest, PrefillResult
from services.duty import Duty, Handler
from services.kv_handoff import KvStream
from services.prefill.kv_targets import KvTargets
from services.prefill.result_messages import first_token_deltas, first_tokens, kv_committed
from services.superseded import Mark
from shared import tracing
from shared.errors import (
    EngineFailure,
    ErrorCode,
    HalfmoonError,
    InvalidRequest,
    RequestAborted,
    TransferFailed,
    TransferTimeout,
    WorkerUnavailable,
)
from shared.messages import (
    AbortRequest,
    DecodeReplacement,
    DispatchReply,
    GenerateRequest,
    KvLeaseKind,
    KvLeaseRenewal,
    KvTarget,
    PrefillTask,
    PrefixFetch,
    PrefixFetched,
    PrefixSource,
    request_failed,
)
from shared.nats_client import dispatch, encode
from shared.token_batches import encoded_batches

if TYPE_CHECKING:
    from services.worker import WorkerService

COMMIT_TIMEOUT_S = 5.0
MAX_HANDOFF_RETRIES = 2  # decode workers tried again with the KV prefill holds
# Asking again for a decode worker while the KV is held: the first pause, doubling to the last.
REPLACEMENT_PAUSES_S = (0.1, 1.0)
LEASE_KINDS: tuple[KvLeaseKind, ...] = ("prefix_fetch", "prefill_hold")  # this role's holds


class _Running(NamedTuple):
    """A request this worker prefills (and hands off): its task, and which attempt."""

    task: asyncio.Task[None]
    attempt: int


class PrefillDuty(Duty):
    """The prefill role: tasks from conductors, KV targets from decode, prefix fetches from
    other prefill workers."""

    role = "prefill"

    def __init__(self, worker: WorkerService) -> None:
        super().__init__(worker)
        self.prefix_sharing = worker.prefix_sharing
        self._in_flight: dict[str, _Running] = {}
        self._targets = KvTargets()

    def _handlers(self) -> list[Handler]:
        s, me = self.subjects, self.worker_id
        return [(s.prefill_task(me), PrefillTask, self._on_task),
                (s.kv_target(me), KvTarget, self._on_target),
                (s.prefix_fetch(me), PrefixFetch, self._on_prefix_fetch)]

    def num_waiting(self) -> int:
        return len(self._in_flight)

    async def _on_task(self, task: PrefillTask) -> DispatchReply:
        request, marks = task.request, self.worker.superseded
        if (stale := self.refusal_if_stale(request, task.delivery)) is not None:
            return stale
        if self.is_draining:
            return self.worker.refusal("worker is draining")
        if marks.replaces(request, task.delivery):  # stop the earlier delivery's run now
            self.abort(request.request_id, placed_from=(request.attempt, task.delivery))
        if (running := self._in_flight.get(request.request_id)) is not None:
            if running.attempt >= request.attempt:
                return self.worker.accept()  # a redelivery of a task we already run
            # The gateway aborts an attempt before it places the next; that abort was lost.
            # Never one for the other (their KV differs): placed elsewhere, or held.
            return self.worker.refusal(f"attempt {running.attempt} of the request still "
                                       "runs here")
        if len(self._in_flight) >= self.config.max_queue:
            return self.worker.refusal(f"prefill queue full ({self.config.max_queue})",
                                       code=ErrorCode.CAPACITY_EXHAUSTED)  # room will free
        self._in_flight[request.request_id] = _Running(self.worker.spawn(
            self._run(request, task.prefix_source), f"request.{request.request_id}"
        ), request.attempt)
        marks.placed(request.request_id, request.attempt, task.delivery)
        self.log.debug("prefill.task", request_id=request.request_id, attempt=request.attempt,
                       delivery=task.delivery)
        return self.worker.accept()

    async def _on_prefix_fetch(self, fetch: PrefixFetch) -> PrefixFetched:
        if self.prefix_sharing is None:
            raise InvalidRequest("this worker keeps no KV to share")
        if self.is_draining:  # the fetcher computes the prefix itself
            raise WorkerUnavailable("worker is draining")
        return await self.prefix_sharing.serve(fetch)

    async def _on_target(self, target: KvTarget) -> DispatchReply | None:
        self.log.debug("prefill.kv_target", request_id=target.request_id,
                       decode_worker_id=target.decode_worker_id)
        self._targets.receive(target)
        return None

    def abort(self, request_id: str, *, placed_from: Mark | None = None) -> None:
        running = self._in_flight.pop(request_id, None)
        if running is not None:
            running.task.cancel()
        self._forget(request_id, keep_from=placed_from)

    def _is_mine(self, request_id: str) -> bool:
        """Whether the running task is the request's run here (not one aborted since)."""
        running = self._in_flight.get(request_id)
        return running is not None and running.task is asyncio.current_task()

    def _forget(self, request_id: str, *, keep_from: Mark | None = None) -> None:
        """Drop the request's KV target (unless it belongs to a placement from `keep_from`
        on) and its engine state."""
        self._targets.forget(request_id, keep_from=keep_from)
        self.engine.release(request_id)

    def on_tick(self) -> None:
        # Targets for requests that never came here (the conductor placed them elsewhere).
        cutoff = time.monotonic() - self.config.transfer.kv_wait_timeout_s
        for request_id in self._targets.first_heard_before(cutoff):
            if request_id not in self._in_flight:
                self._forget(request_id)
        # Blocks a peer's transfer may have been writing, or was reading.
        for lease in self.leases.expired(LEASE_KINDS):
            self.log.warning("kv_lease.expired", kind=lease.kind, request_id=lease.request_id,
                             party=lease.party, blocks_freed=len(lease.block_ids))
            self.engine.prefix_cache.release_blocks(lease.block_ids)
        if renewals := self._renewals():
            self.worker.spawn(self._renew_reservations(renewals), "lease-renewals")

    def _renewals(self) -> dict[str, list[str]]:
        """The requests queued or computing here, by the decode worker holding their KV."""
        renewals: dict[str, list[str]] = defaultdict(list)
        for request_id in self._in_flight:
            if (decode_worker_id := self._targets.decode_worker_of(request_id)) is not None:
                renewals[decode_worker_id].append(request_id)
        return renewals

    async def _renew_reservations(self, renewals: dict[str, list[str]]) -> None:
        for decode_worker_id, request_ids in renewals.items():
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(self.subjects.kv_lease_renewal(decode_worker_id), encode(
                    KvLeaseRenewal(prefill_worker_id=self.worker_id, request_ids=request_ids)))

    async def _run(self, request: GenerateRequest, source: PrefixSource | None) -> None:
        with tracing.continued_span(__name__, "prefill.request", attributes={
                "halfmoon.request_id": request.request_id, "halfmoon.worker": self.worker_id,
                "halfmoon.prompt_tokens": len(request.prompt_token_ids)}), \
                structlog.contextvars.bound_contextvars(request_id=request.request_id):
            await self._run_traced(request, source)

    async def _run_traced(self, request: GenerateRequest, source: PrefixSource | None) -> None:
        error: HalfmoonError | None = None
        try:
            if source is not None and self.prefix_sharing is not None:
                await self.prefix_sharing.fetch(request.request_id, request.prompt_token_ids,
                                                source)
            await self._prefill_and_hand_off(request)
        except asyncio.CancelledError:
            if self._is_mine(request.request_id):  # shutdown, not an abort
                await self._fail(request, RequestAborted("prefill worker stopped"))
            raise
        except RequestAborted as exc:  # a peer heard its gateway end it: nothing to tell
            self.log.debug("prefill.ended", request_id=request.request_id, reason=exc.message)
        except HalfmoonError as exc:
            error = exc
        except Exception as exc:
            self.log.error("prefill.failed", request_id=request.request_id, exc_info=exc)
            error = EngineFailure(f"prefill failed: {exc!r}")
        finally:
            # An aborted run (its abort forgot it) ends a loop turn later, when a run placed
            # again may hold the request's entry, target and engine state here: not its own.
            if self._is_mine(request.request_id):
                self._in_flight.pop(request.request_id, None)
                self._forget(request.request_id)
        if error is not None:
            await self._fail(request, error)

    async def _prefill_and_hand_off(self, request: GenerateRequest) -> None:
        stream = self.handoff.open(request.request_id, self._targets.future(request.request_id))
        try:
            await self._prefill_and_stream(request, stream)
        finally:
            stream.cancel()  # a no-op once finished

    async def _prefill_and_stream(self, request: GenerateRequest, stream: KvStream) -> None:
        started = time.perf_counter()
        layers: list[tuple[int, float]] = []  # (layer, when it completed), when tracing
        on_layer = stream.on_layer
        if tracing.recording_span() is not None:  # the request's, when traced
            def on_layer(layer: int, block_ids: list[int]) -> None:  # engine thread
                layers.append((layer, time.perf_counter()))
                if stream.on_layer is not None:
                    stream.on_layer(layer, block_ids)
        result = await self.engine.prefill(PrefillRequest(
            request.request_id, request.prompt_token_ids, request.sampling, on_layer=on_layer,
            output_offset=request.output_offset, priority=request.priority,
        ))
        self._observe_prefill(request, result, started, layers)
        self.worker.kv_events.publish_soon()
        if self.engine.stats().num_waiting_tokens == 0:  # the queue drained: say so now,
            self.worker.heartbeats.soon()  # not as queued till the next heartbeat
        sampling = request.sampling
        if sampling.temperature > 0 and sampling.seed is None \
                and not self._targets.future(request.request_id).done():
            # A draw no other run repeats goes out once decode has accepted (its target is
            # on its way long before a real prefill ends): a request whose decode side
            # refused is held and placed again, and this run's first token would reach the
            # client while the next run samples its own. Greedy and seeded ones do not wait.
            await self._wait_for_target(request.request_id)
        await self._send_first_token(request, result)
        if all(first.finish_reason is not None for first in first_tokens(result)):
            # Done already: free decode's reservation. Leave the in-flight table first so
            # that our own abort, echoed back to us, cannot cancel this task.
            self._in_flight.pop(request.request_id, None)
            self._forget(request.request_id)
            await self._publish_abort(request.request_id, "finished at prefill")
            return
        await self._hand_off(request, result, stream)

    async def _hand_off(self, request: GenerateRequest, result: PrefillResult,
                        stream: KvStream) -> None:
        """Finish the KV handoff and commit it. When it fails after the KV was computed (the
        decode worker died, refused, or its data plane is gone), keep the KV under a
        `prefill_hold` lease and have a conductor place the decode side again, up to
        `MAX_HANDOFF_RETRIES` times: the prompt is never computed twice."""
        streams = [stream]
        try:
            for attempt in range(MAX_HANDOFF_RETRIES + 1):
                target = await self._wait_for_target(request.request_id)
                try:
                    await self._commit(request, result, streams[-1], target)
                    return
                except (TransferFailed, TransferTimeout, WorkerUnavailable) as exc:
                    if attempt == MAX_HANDOFF_RETRIES:
                        raise
                    streams.append(await self._replace_decode(request, result, target, exc))
        finally:
            self.leases.release("prefill_hold", request.request_id)
            for opened in streams[1:]:
                opened.cancel()

    async def _replace_decode(self, request: GenerateRequest, result: PrefillResult,
                              failed: KvTarget, error: HalfmoonError) -> KvStream:
        """Hold the KV, ask a conductor for another decode worker, and return a stream that
        sends every layer to the target it will name."""
        request_id, hold_s = request.request_id, self.config.transfer.kv_hold_s
        self.log.warning("handoff.failed", request_id=request_id, error=error.message,
                         decode_worker_id=failed.decode_worker_id, action="replacing decode")
        self.leases.grant("prefill_hold", request_id, failed.decode_worker_id,
                          len(result.block_ids), hold_s)
        fresh = self._targets.fresh(request_id)
        await self._ask_for_decode(DecodeReplacement(
            request=request, prefill_worker_id=self.worker_id,
            failed_decode_worker_id=failed.decode_worker_id, reason=error.message), hold_s)
        # The asking may have taken most of the hold: the transfer gets a whole one.
        self.leases.renew("prefill_hold", request_id, failed.decode_worker_id, hold_s)
        stream = self.handoff.open(request_id, fresh)
        layout = self.engine.kv_layout()
        if stream.on_layer is not None and layout is not None:
            for layer in range(layout.num_layers):  # all of it is computed already
                stream.on_layer(layer, result.block_ids)
        return stream

    async def _ask_for_decode(self, replacement: DecodeReplacement, hold_s: float) -> None:
        """Ask the conductors for another decode worker until one accepts, while the KV is
        held: a handoff fails most often when the bus did (a NATS node restarting), and
        then for a moment no conductor listens yet, or none has heard a decode worker back.
        Raises `WorkerUnavailable` with the last answer once the hold is over."""
        deadline = time.monotonic() + hold_s
        pause_s, longest_s = REPLACEMENT_PAUSES_S
        while True:
            try:
                reply = await dispatch(self.nc, self.subjects.decode_replacement, replacement,
                                       max(deadline - time.monotonic(), pause_s))
                if reply.is_accepted:
                    return
                if reply.code == ErrorCode.ABORTED:  # ended: no decode worker wanted
                    raise RequestAborted(reply.reason)
                reason = reply.reason
            except WorkerUnavailable as exc:
                reason = exc.message
            if time.monotonic() + pause_s >= deadline:
                raise WorkerUnavailable(f"no other decode worker: {reason}")
            self.log.info("handoff.replacement_retry", request_id=replacement.request.request_id,
                          reason=reason, pause_s=pause_s)
            await asyncio.sleep(pause_s)
            pause_s = min(2 * pause_s, longest_s)

    async def _commit(self, request: GenerateRequest, result: PrefillResult, stream: KvStream,
                      target: KvTarget) -> None:
        """Wait until the KV landed in `target`'s blocks, then tell its decode worker."""
        report = await stream.finish(result, self.config.transfer.kv_wait_timeout_s)
        with tracing.attached(report.trace_context):  # decode's spans follow the transfer's
            reply = await dispatch(self.nc, self.subjects.kv_commit(target.decode_worker_id),
                                   kv_committed(request, result, report, self.worker_id),
                                   COMMIT_TIMEOUT_S)
        if reply.code == ErrorCode.ABORTED:  # its gateway ended it: the abort is on its way
            raise RequestAborted(reply.reason)
        if not reply.is_accepted:
            raise WorkerUnavailable(f"decode worker refused the commit: {reply.reason}")
        if report.num_bytes:
            self.metrics.observe_transfer(report.transport, report.num_bytes, report.seconds)
        await self.worker.events.request(
            "kv_committed", request.request_id, model=request.model,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=result.num_cached_tokens, prefill_worker_id=self.worker_id,
            decode_worker_id=target.decode_worker_id, num_kv_bytes=report.num_bytes,
            transport=report.transport, kv_seconds=report.seconds,
            kv_compression=report.compression, num_kv_wire_bytes=report.wire_bytes)
        self.log.debug("prefill.committed", request_id=request.request_id,
                       decode_worker_id=target.decode_worker_id, kv_bytes=report.num_bytes,
                       kv_wire_bytes=report.wire_bytes, kv_compression=report.compression,
                       transport=report.transport, kv_seconds=round(report.seconds, 6),
                       kv_tail_seconds=round(report.tail_s, 6))

    def _observe_prefill(self, request: GenerateRequest, result: PrefillResult, started: float,
                         layers: list[tuple[int, float]]) -> None:
        """Metrics, and (when tracing) the engine's timings on the request's span: queue and
        compute seconds as attributes, compute start and each layer as events (spans cost at
        100 % sampling; these were two spans of their own)."""
        done = time.perf_counter()
        compute_s = min(result.compute_s, done - started)
        self.metrics.queue_time.observe(done - started - compute_s)
        self.metrics.prefill_seconds.observe(done - started)
        self.metrics.observe_prompt(len(request.prompt_token_ids), result.num_cached_tokens)
        span = tracing.recording_span()
        if span is None:
            return
        span.set_attributes({
            "halfmoon.cached_tokens": result.num_cached_tokens,
            "halfmoon.computed_tokens": len(request.prompt_token_ids) - result.num_cached_tokens,
            "halfmoon.queue_s": done - started - compute_s, "halfmoon.compute_s": compute_s})
        span.add_event("compute", timestamp=tracing.unix_ns(done - compute_s))
        for layer, at in layers:
            span.add_event("layer", {"layer": layer}, timestamp=tracing.unix_ns(at))

    async def _send_first_token(self, request: GenerateRequest, result: PrefillResult) -> None:
        items = first_token_deltas(request, result)
        for batch in encoded_batches(self.worker_id, items, self.nc.max_payload):
            await self.nc.publish(request.reply_subject, batch)

    async def _wait_for_target(self, request_id: str) -> KvTarget:
        return await self._targets.wait(request_id, self.config.transfer.kv_wait_timeout_s)

    async def _fail(self, request: GenerateRequest, error: HalfmoonError) -> None:
        failure = request_failed(request.request_id, error, self.worker_id)
        await self.nc.publish(request.reply_subject, encode(failure))
        await self._publish_abort(request.request_id, error.message)

    async def _publish_abort(self, request_id: str, reason: str) -> None:
        await self.nc.publish(self.subjects.abort,
                              encode(AbortRequest(request_id=request_id, reason=reason)))

    def is_idle(self) -> bool:
        # Leases too: a peer may be reading cached blocks of ours (a prefix fetch).
        return not self._in_flight and self.leases.count(LEASE_KINDS) == 0

    async def stop(self) -> None:
        await super().stop()
        for request_id in self._targets:  # targets of requests placed elsewhere
            self._forget(request_id)

