"""The decode worker: reserves KV blocks, joins committed requests, streams tokens.

A request's life here:
  1. `DecodeReservation` (request/reply): reserve blocks for prompt + max_tokens, send the
     `KvTarget` to the named prefill worker, accept. A repeated reservation (the conductor
     re-placed prefill) keeps the blocks and re-sends the target to the new prefill worker.
  2. `KvCommitted` (request/reply): the KV is in; join the running batch.
  3. Each engine step yields one token per running request; they go out as one `TokenBatch`
     per gateway per step. Finished requests leave the batch and free their blocks.
A reservation whose commit does not come within `kv_wait_timeout_s` is freed; an abort frees
the request at whatever step it is.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, StatusCode

from engine.protocol import DecodeRequest, PrefillRequest, TokenOutput
from services.worker import WorkerService
from shared import tracing
from shared.errors import HalfmoonError, RequestAborted, TransferTimeout
from shared.messages import (
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    KvCommitted,
    KvTarget,
    RequestFailed,
    TokenBatch,
    TokenDelta,
)
from shared.metrics import DecodeMetrics
from shared.nats_client import encode
from transfer_engine.batch import Notification
from transfer_engine.handoff import decode_notice


@dataclass
class Reservation:
    request: GenerateRequest
    prefill_worker_id: str
    block_ids: list[int]
    reserved_at_s: float


class DecodeSpans:
    """Each running request's `decode.stream` span (join to last token) and, until its first
    token, `decode.first_step`; children of the context current at the join (the prefill
    side's, from `KvCommitted`'s headers). Nothing is kept when not tracing."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[Span, Span | None]] = {}

    def start(self, request_id: str, worker_id: str) -> None:
        if not tracing.is_enabled():
            return
        tracer = tracing.tracer(__name__)
        attributes = {"halfmoon.request_id": request_id, "halfmoon.worker": worker_id}
        stream = tracer.start_span("decode.stream", attributes=attributes)
        with tracing.attached(trace.set_span_in_context(stream)):
            first = tracer.start_span("decode.first_step", attributes=attributes)
        self._open[request_id] = (stream, first)

    def step(self, output: TokenOutput) -> None:
        spans = self._open.get(output.request_id)
        if spans is None:
            return
        stream, first = spans
        if first is not None:
            first.end()
            self._open[output.request_id] = (stream, None)
        if output.finish_reason is not None:
            stream.set_attributes({"halfmoon.output_tokens": output.index + 1,
                                   "halfmoon.finish_reason": output.finish_reason})
            self.end(output.request_id)

    def end(self, request_id: str, error: str | None = None) -> None:
        spans = self._open.pop(request_id, None)
        if spans is None:
            return
        stream, first = spans
        for span in (first, stream):
            if span is not None:
                if error is not None:
                    span.set_status(StatusCode.ERROR, error)
                span.end()


class DecodeService(WorkerService):
    name = "decode"
    role = "decode"
    metrics_type = DecodeMetrics
    metrics: DecodeMetrics

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reservations: dict[str, Reservation] = {}
        self._active: dict[str, GenerateRequest] = {}
        self.kv_commits: Counter[str] = Counter()  # committed requests by KV transport
        self._spans = DecodeSpans()
        self._last_step_at: float | None = None

    async def _subscribe_work(self) -> list[Any]:
        subscriptions = [
            await self.serve(self.subjects.decode_reserve(self.worker_id), DecodeReservation,
                             self._on_reserve),
            await self.serve(self.subjects.kv_commit(self.worker_id), KvCommitted,
                             self._on_commit),
        ]
        self.spawn(self._step_loop(), "steps")
        return subscriptions

    @property
    def num_open_requests(self) -> int:
        return len(self._reservations) + len(self._active)

    def _num_waiting(self) -> int:
        return len(self._reservations)

    async def _on_reserve(self, message: DecodeReservation) -> DispatchReply:
        request = message.request
        if self.is_draining:
            return self._refusal("worker is draining")
        if message.is_local_prefill:
            return self._prefill_here(request)
        reservation = self._reservations.get(request.request_id)
        if reservation is None:
            num_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
            block_ids = self.engine.reserve(request.request_id, num_tokens)
            reservation = Reservation(request, message.prefill_worker_id, block_ids,
                                      time.monotonic())
            self._reservations[request.request_id] = reservation
        reservation.prefill_worker_id = message.prefill_worker_id
        if tracing.is_enabled():
            tracing.record_span(__name__, "decode.reserve", time.perf_counter(),
                                time.perf_counter(), {
                                    "halfmoon.request_id": request.request_id,
                                    "halfmoon.worker": self.worker_id,
                                    "halfmoon.reserved_blocks": len(reservation.block_ids),
                                    "halfmoon.prefill_worker": message.prefill_worker_id})
        layout = self.engine.kv_layout()
        target = KvTarget(request_id=request.request_id, decode_worker_id=self.worker_id,
                          block_ids=reservation.block_ids,
                          kv_num_blocks=layout.num_blocks if layout else 0,
                          kv_block_bytes=layout.block_bytes if layout else 0)
        await self.nc.publish(self.subjects.kv_target(message.prefill_worker_id), encode(target))
        return self.accept()

    def _prefill_here(self, request: GenerateRequest) -> DispatchReply:
        """Colocated: the engine prefills and decodes; every token comes from the step loop."""
        if request.request_id not in self._active:
            self.engine.generate(PrefillRequest(request.request_id, request.prompt_token_ids,
                                                request.sampling))
            self._active[request.request_id] = request
            self._count_commit("local")
            self._spans.start(request.request_id, self.worker_id)
        return self.accept()

    def _count_commit(self, transport: str) -> None:
        self.kv_commits[transport] += 1
        self.metrics.kv_commits.labels(transport).inc()

    async def _on_commit(self, message: KvCommitted) -> DispatchReply:
        reservation = self._reservations.pop(message.request_id, None)
        if reservation is None:
            return self._refusal(f"no reservation for {message.request_id}")
        request = reservation.request
        self._count_commit(message.transport)
        self._spans.start(request.request_id, self.worker_id)
        self.log.info("decode.kv_committed", request_id=request.request_id,
                      prefill_worker_id=message.prefill_worker_id,
                      kv_bytes=message.num_kv_bytes, transport=message.transport)
        # No KV crossed (the handoff had nothing to move it with): recompute the prompt here.
        self.engine.join(DecodeRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            first_token_id=message.first_token_id, sampling=request.sampling,
            is_kv_ready=message.transport != "none",
        ))
        self._active[request.request_id] = request
        return self.accept()

    async def _step_loop(self) -> None:
        while True:
            outputs = await self.engine.next_step()
            now = time.perf_counter()
            if self._last_step_at is not None and outputs:
                self.metrics.step_seconds.observe(now - self._last_step_at)
            # Consecutive steps only: an idle engine's wait is not a step.
            self._last_step_at = now if self._active else None
            self.metrics.generated_tokens.inc(len(outputs))
            await self._publish_step(outputs)

    def _on_kv_notice(self, notification: Notification) -> None:
        """The KV of a request landed: a `kv.received` span, child of the prefill side's
        `kv.transfer`, whose context came with the transfer engine's notification."""
        notice = decode_notice(notification.payload)
        if notice is None or not tracing.is_enabled():
            return
        with tracing.attached(tracing.extract(notice.trace_context)):
            now = time.perf_counter()
            tracing.record_span(__name__, "kv.received", now, now, {
                "halfmoon.request_id": notice.request_id, "halfmoon.worker": self.worker_id,
                "halfmoon.prefill_worker": notification.peer_id})

    async def _publish_step(self, outputs: list[TokenOutput]) -> None:
        by_gateway: dict[str, list[TokenDelta]] = defaultdict(list)
        for output in outputs:
            request = self._active.get(output.request_id)
            if request is None:
                continue  # aborted while the step ran
            if output.error is not None:
                del self._active[output.request_id]
                self._spans.end(output.request_id, error=output.error.message)
                await self._fail(request, output.error)
                continue
            self._spans.step(output)
            by_gateway[request.reply_subject].append(TokenDelta(
                request_id=output.request_id, index=request.output_offset + output.index,
                token_ids=[output.token_id],
                finish_reason=output.finish_reason,
                num_cached_tokens=output.num_cached_tokens,
            ))
            if output.finish_reason is not None:
                del self._active[output.request_id]
        for subject, items in by_gateway.items():
            await self.nc.publish(subject, encode(TokenBatch(worker_id=self.worker_id,
                                                             items=items)))

    async def _fail(self, request: GenerateRequest, error: HalfmoonError) -> None:
        failure = RequestFailed(request_id=request.request_id, code=error.code,
                                message=error.message, worker_id=self.worker_id)
        await self.nc.publish(request.reply_subject, encode(failure))

    def _abort(self, request_id: str) -> None:
        self._reservations.pop(request_id, None)
        self._active.pop(request_id, None)
        self._spans.end(request_id, error="aborted")
        self.engine.abort(request_id)

    def _on_tick(self) -> None:
        cutoff = time.monotonic() - self.config.kv_wait_timeout_s
        for request_id, reservation in list(self._reservations.items()):
            if reservation.reserved_at_s < cutoff:
                self.log.warning("decode.reservation_expired", request_id=request_id,
                                 prefill_worker_id=reservation.prefill_worker_id)
                self._abort(request_id)
                # The client may hold a first token already: tell it the rest is not coming.
                error = TransferTimeout(f"the KV from prefill worker "
                                        f"{reservation.prefill_worker_id} never arrived")
                self.spawn(self._fail(reservation.request, error), f"expire.{request_id}")

    async def _drain(self) -> None:
        await self.wait_until(lambda: self.num_open_requests == 0)

    async def _close(self) -> None:
        # Whatever is still open after the drain is failed loudly, never left hanging.
        requests = list(self._active.values()) + [r.request for r in self._reservations.values()]
        for request in requests:
            self._abort(request.request_id)
            if self._nc is not None and not self._nc.is_closed:
                await self._fail(request, RequestAborted("decode worker stopped"))
        await super()._close()
