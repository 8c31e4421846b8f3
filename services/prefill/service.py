"""The prefill worker: computes prompts, sends first tokens, hands KV to decode.

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
import time
from typing import Any

import structlog

from engine.protocol import Engine, PrefillRequest, PrefillResult
from services.prefill.prefix_reuse import PrefixSharing
from services.worker import WorkerService
from shared import tracing
from shared.config import WorkerConfig
from shared.errors import (
    EngineFailure,
    HalfmoonError,
    InvalidRequest,
    RequestAborted,
    TransferTimeout,
    WorkerUnavailable,
)
from shared.messages import (
    AbortRequest,
    DispatchReply,
    GenerateRequest,
    KvCommitted,
    KvTarget,
    PrefillTask,
    PrefixFetch,
    PrefixFetched,
    PrefixSource,
    RequestFailed,
    TokenBatch,
    TokenDelta,
)
from shared.metrics import PrefillMetrics
from shared.nats_client import dispatch, encode
from transfer_engine.handoff import (
    KvHandoff,
    KvStream,
    LayerwiseKvHandoff,
    NoKvHandoff,
    SimulatedLink,
)

COMMIT_TIMEOUT_S = 5.0


class PrefillService(WorkerService):
    name = "prefill"
    role = "prefill"
    metrics_type = PrefillMetrics
    metrics: PrefillMetrics

    def __init__(
        self, config: WorkerConfig, engine: Engine | None = None,
        handoff: KvHandoff | None = None,
    ) -> None:
        super().__init__(config, engine)
        self._handoff = handoff
        self._in_flight: dict[str, asyncio.Task[None]] = {}
        # request id -> (the decode side's KvTarget, when this worker first heard of it)
        self._targets: dict[str, tuple[asyncio.Future[KvTarget], float]] = {}
        self._prefix_sharing: PrefixSharing | None = None

    @property
    def handoff(self) -> KvHandoff:
        if self._handoff is None:
            layout = self.engine.kv_layout()
            self._handoff = NoKvHandoff() if self.transfer is None or layout is None else \
                LayerwiseKvHandoff(self.transfer, layout,
                                   is_layerwise=self.config.kv_streaming == "layerwise",
                                   link=self._simulated_link())
        return self._handoff

    def _simulated_link(self) -> SimulatedLink | None:
        """A simulated engine's KV is scaled down; its transfers take the full size's time."""
        config = self.config
        if config.engine != "sim" or config.sim_link_bytes_per_s <= 0:
            return None
        return SimulatedLink(config.sim_link_bytes_per_s, config.sim_kv_byte_scale,
                             config.sim_time_scale)

    @property
    def prefix_sharing(self) -> PrefixSharing | None:
        """Prefix reuse across workers; None for an engine with no KV to move."""
        layout = self.engine.kv_layout()
        if self._prefix_sharing is None and self.transfer is not None and layout is not None:
            self._prefix_sharing = PrefixSharing(
                worker_id=self.worker_id, engine=self.engine, layout=layout,
                transfer=self.transfer, nc=self.nc, subjects=self.subjects,
                block_size=self.config.block_size, timeout_s=self.config.kv_wait_timeout_s,
                metrics=self.metrics)
        return self._prefix_sharing

    async def _subscribe_work(self) -> list[Any]:
        return [
            await self.serve(self.subjects.prefill_task(self.worker_id), PrefillTask,
                             self._on_task),
            await self.serve(self.subjects.kv_target(self.worker_id), KvTarget,
                             self._on_target),
            await self.serve(self.subjects.prefix_fetch(self.worker_id), PrefixFetch,
                             self._on_prefix_fetch),
        ]

    def _num_waiting(self) -> int:
        return len(self._in_flight)

    async def _on_task(self, task: PrefillTask) -> DispatchReply:
        request = task.request
        if self.is_draining:
            return self._refusal("worker is draining")
        if request.request_id in self._in_flight:
            return self.accept()  # a redelivery of a task we already run
        if len(self._in_flight) >= self.config.max_queue:
            return self._refusal(f"prefill queue full ({self.config.max_queue})")
        self._in_flight[request.request_id] = self.spawn(
            self._run(request, task.prefix_source), f"request.{request.request_id}"
        )
        return self.accept()

    async def _on_prefix_fetch(self, fetch: PrefixFetch) -> PrefixFetched:
        if self.prefix_sharing is None:
            raise InvalidRequest("this worker keeps no KV to share")
        return await self.prefix_sharing.serve(fetch)

    async def _on_target(self, target: KvTarget) -> DispatchReply | None:
        future = self._target_future(target.request_id)
        if future.done():  # decode was re-placed: the newest target wins
            future = asyncio.get_running_loop().create_future()
            self._targets[target.request_id] = (future, time.monotonic())
        future.set_result(target)
        return None

    def _target_future(self, request_id: str) -> asyncio.Future[KvTarget]:
        if request_id not in self._targets:
            future = asyncio.get_running_loop().create_future()
            self._targets[request_id] = (future, time.monotonic())
        return self._targets[request_id][0]

    def _abort(self, request_id: str) -> None:
        task = self._in_flight.pop(request_id, None)
        if task is not None:
            task.cancel()
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self.engine.release(request_id)

    def _on_tick(self) -> None:
        # Targets for requests that never came here (the conductor placed them elsewhere).
        cutoff = time.monotonic() - self.config.kv_wait_timeout_s
        for request_id, (_, seen_at) in list(self._targets.items()):
            if seen_at < cutoff and request_id not in self._in_flight:
                self._forget(request_id)

    async def _run(self, request: GenerateRequest, source: PrefixSource | None) -> None:
        with tracing.span(__name__, "prefill.request", attributes={
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
            if request.request_id in self._in_flight:  # shutdown, not an abort
                await self._fail(request, RequestAborted("prefill worker stopped"))
            raise
        except HalfmoonError as exc:
            error = exc
        except Exception as exc:
            self.log.error("prefill.failed", request_id=request.request_id, exc_info=exc)
            error = EngineFailure(f"prefill failed: {exc!r}")
        finally:
            self._in_flight.pop(request.request_id, None)
            self._forget(request.request_id)
        if error is not None:
            await self._fail(request, error)

    async def _prefill_and_hand_off(self, request: GenerateRequest) -> None:
        stream = self.handoff.open(request.request_id, self._target_future(request.request_id))
        try:
            await self._prefill_and_stream(request, stream)
        finally:
            stream.cancel()  # a no-op once finished

    async def _prefill_and_stream(self, request: GenerateRequest, stream: KvStream) -> None:
        started = time.perf_counter()
        layers: list[tuple[int, float]] = []  # (layer, when it completed), when tracing
        on_layer = stream.on_layer
        if tracing.is_enabled():
            def on_layer(layer: int, block_ids: list[int]) -> None:  # engine thread
                layers.append((layer, time.perf_counter()))
                if stream.on_layer is not None:
                    stream.on_layer(layer, block_ids)
        result = await self.engine.prefill(PrefillRequest(
            request.request_id, request.prompt_token_ids, request.sampling, on_layer=on_layer,
        ))
        self._observe_prefill(request, result, started, layers)
        self.publish_kv_events_soon()
        await self._send_first_token(request, result)
        if result.finish_reason is not None:
            # Done already: free decode's reservation. Leave the in-flight table first so
            # that our own abort, echoed back to us, cannot cancel this task.
            self._in_flight.pop(request.request_id, None)
            await self._publish_abort(request.request_id, "finished at prefill")
            return
        target = await self._wait_for_target(request.request_id)
        report = await stream.finish(result, self.config.kv_wait_timeout_s)
        reply = await dispatch(
            self.nc, self.subjects.kv_commit(target.decode_worker_id),
            KvCommitted(
                request_id=request.request_id, prefill_worker_id=self.worker_id,
                first_token_id=result.first_token_id,
                num_prompt_tokens=len(request.prompt_token_ids),
                num_kv_bytes=report.num_bytes, transport=report.transport,
            ),
            COMMIT_TIMEOUT_S,
        )
        if not reply.is_accepted:
            raise WorkerUnavailable(f"decode worker refused the commit: {reply.reason}")
        if report.num_bytes:
            self.metrics.observe_transfer(report.transport, report.num_bytes, report.seconds)
        self.log.info("prefill.committed", request_id=request.request_id,
                      decode_worker_id=target.decode_worker_id, kv_bytes=report.num_bytes,
                      transport=report.transport, kv_seconds=round(report.seconds, 6),
                      kv_tail_seconds=round(report.tail_s, 6))

    def _observe_prefill(self, request: GenerateRequest, result: PrefillResult, started: float,
                         layers: list[tuple[int, float]]) -> None:
        """Metrics, and (when tracing) the queue and compute spans, timed by the engine."""
        done = time.perf_counter()
        compute_s = min(result.compute_s, done - started)
        self.metrics.queue_time.observe(done - started - compute_s)
        self.metrics.prefill_seconds.observe(done - started)
        self.metrics.observe_prompt(len(request.prompt_token_ids), result.num_cached_tokens)
        if not tracing.is_enabled():
            return
        tracing.record_span(__name__, "prefill.queue", started, done - compute_s)
        tracing.record_span(
            __name__, "prefill.compute", done - compute_s, done,
            {"halfmoon.cached_tokens": result.num_cached_tokens,
             "halfmoon.computed_tokens": len(request.prompt_token_ids)
             - result.num_cached_tokens},
            [("layer", at, {"layer": layer}) for layer, at in layers])

    async def _send_first_token(self, request: GenerateRequest, result: PrefillResult) -> None:
        delta = TokenDelta(request_id=request.request_id, index=request.output_offset,
                           token_ids=[result.first_token_id],
                           finish_reason=result.finish_reason,
                           num_cached_tokens=result.num_cached_tokens)
        batch = TokenBatch(worker_id=self.worker_id, items=[delta])
        await self.nc.publish(request.reply_subject, encode(batch))

    async def _wait_for_target(self, request_id: str) -> KvTarget:
        timeout_s = self.config.kv_wait_timeout_s
        try:
            return await asyncio.wait_for(
                asyncio.shield(self._target_future(request_id)), timeout_s
            )
        except TimeoutError as exc:
            raise TransferTimeout(
                f"no KV target from a decode worker within {timeout_s}s"
            ) from exc

    async def _fail(self, request: GenerateRequest, error: HalfmoonError) -> None:
        failure = RequestFailed(request_id=request.request_id, code=error.code,
                                message=error.message, worker_id=self.worker_id)
        await self.nc.publish(request.reply_subject, encode(failure))
        await self._publish_abort(request.request_id, error.message)

    async def _publish_abort(self, request_id: str, reason: str) -> None:
        await self.nc.publish(self.subjects.abort,
                              encode(AbortRequest(request_id=request_id, reason=reason)))

    async def _drain(self) -> None:
        await self.wait_until(lambda: not self._in_flight)

    async def _close(self) -> None:
        if self._handoff is not None:
            await self._handoff.close()
        await super()._close()
