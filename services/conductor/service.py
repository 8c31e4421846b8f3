"""The conductor: takes requests off the JetStream work queue and places them.

Replicas share one durable pull consumer, so each request is placed once. Per request:
pick a prefill and a decode worker from live heartbeats, send `PrefillTask` and
`DecodeReservation` at the same time, and ack the request once both workers accepted. When
one side refuses or is gone, only that side is placed again (up to `max_placement_attempts`),
the accepted side is kept; when placement is impossible the gateway gets `RequestFailed`
(429 for capacity, 503 for no workers) and any accepted side is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, defaultdict
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace

from services.conductor.cost_model import (
    Slo,
    TransferCost,
    check_slo,
    predicted_tbt_s,
    predicted_ttft_s,
)
from services.conductor.placement import (
    PendingWork,
    PrefixView,
    SeedInputs,
    blocks_needed,
    pick_decode,
    pick_prefill,
    prefix_source,
)
from services.conductor.prefix_index import PrefixIndex
from shared import tracing
from shared.block_hash import block_hashes
from shared.config import ConductorConfig
from shared.errors import HalfmoonError, SloViolation, WorkerUnavailable
from shared.heartbeats import WorkerDirectory
from shared.messages import (
    AbortRequest,
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    KvEventBatch,
    PrefillTask,
    PrefixSource,
    RequestFailed,
    RequestPlaced,
    WorkerHeartbeat,
)
from shared.metrics import ConductorMetrics
from shared.nats_client import (
    dispatch,
    encode,
    ensure_kv_event_stream,
    ensure_work_queue,
    read_registry,
)
from shared.service import Service


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


async def _kept() -> None:
    """The answer for a side accepted in an earlier attempt: nothing to send."""
    return None


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
        self._turn = 0
        self._transfer_cost = TransferCost(config.transfer_bytes_per_s,
                                           config.transfer_overhead_s)
        self.rejections: Counter[str] = Counter()  # by reason (also in the metrics)
        self._pending: dict[str, PendingWork] = defaultdict(PendingWork)
        self._num_placing = 0
        self._is_fetching = False
        self._js_subscriptions: list[Any] = []
        # Gauges read at scrape time, not kept up to date on every heartbeat.
        for role in ("prefill", "decode"):
            self.metrics.workers.labels(role).set_function(
                lambda role=role: len(self.workers.healthy(role)))
        self.metrics.prefix_index_blocks.set_function(lambda: len(self.prefix_index))

    async def _setup(self) -> None:
        await self.serve(self.subjects.all_heartbeats, WorkerHeartbeat, self._on_heartbeat)
        for heartbeat in await read_registry(self.nc.jetstream(), self.subjects.workers_bucket):
            self.workers.observe_entry(heartbeat)
        js = self.nc.jetstream()
        await ensure_work_queue(js, self.subjects.requests_stream, self.subjects.requests,
                                max_age_s=self.config.request_max_age_s)
        await self._follow_kv_events(js)
        consumer = ConsumerConfig(
            durable_name=self.subjects.conductor_consumer, ack_policy=AckPolicy.EXPLICIT,
            ack_wait=10.0, max_deliver=5, max_ack_pending=4096,
        )
        self._is_fetching = True
        for i in range(self.config.num_fetchers):
            subscription = await js.pull_subscribe(
                self.subjects.requests, durable=self.subjects.conductor_consumer,
                stream=self.subjects.requests_stream, config=consumer,
            )
            self._js_subscriptions.append(subscription)
            self.spawn(self._fetch_loop(subscription), f"fetch.{i}")

    async def _follow_kv_events(self, js: Any) -> None:
        """Replay the prefix-cache history, then follow it live (an ordered consumer: no
        state on the server, restarted by the client if it falls out of order)."""
        await ensure_kv_event_stream(js, self.subjects)
        decoder = msgspec.json.Decoder(KvEventBatch)

        async def on_batch(msg: Msg) -> None:
            try:
                self.prefix_index.apply(decoder.decode(msg.data))
            except msgspec.DecodeError as exc:
                self.log.warning("message.invalid", subject=msg.subject, error=str(exc))

        self._js_subscriptions.append(await js.subscribe(
            self.subjects.all_kv_events, cb=on_batch, ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)))

    async def _on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self.workers.observe(heartbeat)
        self._pending.pop(heartbeat.worker_id, None)

    async def _fetch_loop(self, subscription: Any) -> None:
        # Each fetcher keeps one pull open; several fetchers place requests concurrently.
        while self._is_fetching:
            try:
                messages = await subscription.fetch(1, timeout=1.0)
            except (nats.errors.TimeoutError, TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            for message in messages:
                self._num_placing += 1
                try:
                    await self._handle(message)
                finally:
                    self._num_placing -= 1

    async def _handle(self, msg: Msg) -> None:
        """Error boundary: decode -> place -> ack; invalid -> term; unexpected -> nak."""
        try:
            request = _request_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            self.log.warning("request.invalid", error=str(exc))
            await msg.term()
            return
        if time.time() - request.created_at_s > self.config.request_max_age_s:
            self.log.warning("request.expired", request_id=request.request_id)
            await msg.ack()
            return
        started = time.perf_counter()
        try:
            with tracing.attached(tracing.extract(msg.headers)), \
                    tracing.span(__name__, "conductor.schedule", attributes={
                        "halfmoon.request_id": request.request_id,
                        "halfmoon.policy": self.config.policy}), \
                    structlog.contextvars.bound_contextvars(request_id=request.request_id):
                prefill_id, decode_id = await self._place(request)
            self.metrics.placement_seconds.observe(time.perf_counter() - started)
            await self.nc.publish(request.reply_subject, encode(RequestPlaced(
                request_id=request.request_id, prefill_worker_id=prefill_id,
                decode_worker_id=decode_id)))
        except HalfmoonError as exc:
            await self._reject(request, exc)
        except Exception as exc:
            self.log.error("request.place_failed", request_id=request.request_id, exc_info=exc)
            await msg.nak(delay=0.5)
            return
        await msg.ack()

    async def _place(self, request: GenerateRequest) -> tuple[str, str]:
        """Place the request; return (prefill worker id, decode worker id)."""
        if self._local_prefill_candidates(request):
            return await self._place_local(request)
        excluded: set[str] = set()
        kept: dict[str, str | None] = {"prefill": None, "decode": None}
        num_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
        prefix = self._prefix_view(request)
        error: HalfmoonError = WorkerUnavailable("no placement attempted")
        for attempt in range(self.config.max_placement_attempts):
            try:
                prefill_worker, decode_worker = self._choose(request, kept, excluded, prefix)
                source = self._prefix_source(prefill_worker, excluded, prefix)
                if attempt == 0:
                    self._admit(request, prefill_worker, decode_worker, prefix, source)
            except HalfmoonError as exc:
                error = exc
                break
            prefill, decode = prefill_worker.worker_id, decode_worker.worker_id
            # A new prefill worker means decode must learn it too (it re-sends the target).
            replies = await asyncio.gather(
                self._dispatch(self.subjects.prefill_task(prefill),
                               PrefillTask(request=request, prefix_source=source))
                if kept["prefill"] is None else _kept(),
                self._dispatch(self.subjects.decode_reserve(decode),
                               DecodeReservation(request=request, prefill_worker_id=prefill))
                if kept["prefill"] is None or kept["decode"] is None else _kept(),
            )
            for role, worker_id, reply in zip(("prefill", "decode"), (prefill, decode), replies,
                                              strict=True):
                if isinstance(reply, DispatchReply) and reply.is_accepted:
                    kept[role] = worker_id
                    if role == "decode":
                        self._count_pending(worker_id, num_tokens)
                    else:
                        self._count_pending(worker_id, 0, self._uncached_tokens(
                            request, prefill_worker, prefix, source))
                elif reply is not None:
                    excluded.add(worker_id)
                    error = self._refusal_error(worker_id, reply)
            if kept["prefill"] and kept["decode"]:
                self._count_placement("disaggregated", prefill_worker, decode_worker, prefix,
                                      source)
                return kept["prefill"], kept["decode"]
        await self._abort(request.request_id, error.message)
        raise error

    def _local_prefill_candidates(self, request: GenerateRequest) -> list[WorkerHeartbeat]:
        """Decode workers that prefill a prompt this short themselves (colocated workers, or
        conditional disaggregation)."""
        num_prompt_tokens = len(request.prompt_token_ids)
        return [worker for worker in self.workers.healthy("decode")
                if num_prompt_tokens <= worker.local_prefill_max_tokens]

    async def _place_local(self, request: GenerateRequest) -> tuple[str, str]:
        """One worker prefills and decodes; no KV moves. Returns (worker id, worker id)."""
        excluded: set[str] = set()
        num_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
        error: HalfmoonError = WorkerUnavailable("no placement attempted")
        for _ in range(self.config.max_placement_attempts):
            try:
                worker = pick_decode(self._local_prefill_candidates(request), excluded,
                                     self._pending, num_tokens).worker_id
            except HalfmoonError as exc:
                error = exc
                break
            reply = await self._dispatch(self.subjects.decode_reserve(worker), DecodeReservation(
                request=request, prefill_worker_id=worker, is_local_prefill=True))
            if isinstance(reply, DispatchReply) and reply.is_accepted:
                self._count_pending(worker, num_tokens)
                chosen = self.workers.get(worker)
                if chosen is not None:
                    self._count_placement("local", chosen, chosen, None, None)
                return worker, worker
            excluded.add(worker)
            error = self._refusal_error(worker, reply)
        await self._abort(request.request_id, error.message)
        raise error

    def _choose(
        self, request: GenerateRequest, kept: dict[str, str | None], excluded: set[str],
        prefix: PrefixView | None,
    ) -> tuple[WorkerHeartbeat, WorkerHeartbeat]:
        """The (prefill, decode) pair for this attempt: sides accepted earlier are kept (a
        kept worker whose heartbeats vanished is chosen again)."""
        decode = self.workers.get(kept["decode"])
        if decode is None:
            kept["decode"] = None
            num_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens
            decode = pick_decode(self.workers.healthy("decode"), excluded, self._pending,
                                 num_tokens)
        prefill = self.workers.get(kept["prefill"])
        if prefill is None:
            kept["prefill"] = None
            self._turn += 1
            prefill = pick_prefill(self.workers.healthy("prefill"), excluded, self._pending,
                                   policy=self.config.policy, prefix=prefix, turn=self._turn,
                                   seed=self._seed_inputs(request, decode))
        return prefill, decode

    def _seed_inputs(self, request: GenerateRequest, decode: WorkerHeartbeat) -> SeedInputs:
        return SeedInputs(num_prompt_tokens=len(request.prompt_token_ids),
                          block_size=decode.block_size, decode_zone=decode.zone,
                          default_tokens_per_s=self.config.default_prefill_tokens_per_s)

    def _prefix_source(self, prefill: WorkerHeartbeat, excluded: set[str],
                       prefix: PrefixView | None) -> PrefixSource | None:
        if prefix is None or not self.config.prefix_fetch:
            return None
        holders = [w for w in self.workers.healthy("prefill") if w.worker_id not in excluded]
        return prefix_source(prefill, holders, prefix, self._transfer_cost,
                             self.config.default_prefill_tokens_per_s)

    def _admit(self, request: GenerateRequest, prefill: WorkerHeartbeat,
               decode: WorkerHeartbeat, prefix: PrefixView | None,
               source: PrefixSource | None) -> None:
        """SLO admission on the chosen pair: reject early rather than serve late."""
        if self.config.ttft_slo_ms is None and self.config.tbt_slo_ms is None:
            return
        transfer_s = 0.0
        if source is not None:
            cached = prefix.cached_blocks.get(prefill.worker_id, 0) if prefix else 0
            transfer_s = self._transfer_cost.seconds(
                (source.num_blocks - cached) * prefill.kv_bytes_per_block)
        queued = self._pending.get(prefill.worker_id, PendingWork()).num_prefill_tokens
        ttft_s = predicted_ttft_s(
            prefill, self._uncached_tokens(request, prefill, prefix, source) + queued,
            self.config.default_prefill_tokens_per_s, transfer_s)
        slo = Slo(ttft_s=_seconds(self.config.ttft_slo_ms), tbt_s=_seconds(self.config.tbt_slo_ms))
        check_slo(ttft_s, predicted_tbt_s(decode), slo)

    @staticmethod
    def _uncached_tokens(request: GenerateRequest, prefill: WorkerHeartbeat,
                         prefix: PrefixView | None, source: PrefixSource | None) -> int:
        """Prompt tokens `prefill` will compute: all but its cached (or fetched) prefix."""
        cached = prefix.cached_blocks.get(prefill.worker_id, 0) if prefix else 0
        if source is not None:
            cached = max(cached, source.num_blocks)
        return max(1, len(request.prompt_token_ids) - cached * prefill.block_size)

    def _prefix_view(self, request: GenerateRequest) -> PrefixView | None:
        workers = self.workers.healthy("prefill")
        is_fetchable = self.config.prefix_fetch and any(w.kv_bytes_per_block for w in workers)
        if not workers or (self.config.policy in ("least-loaded", "round-robin")
                           and not is_fetchable):
            return None
        # Workers of one cluster share a block size; hash with the first one's.
        hashes = block_hashes(request.prompt_token_ids, workers[0].block_size)
        cached = self.prefix_index.leading_blocks(hashes, [w.worker_id for w in workers])
        return PrefixView(num_blocks=len(hashes), cached_blocks=cached)

    async def _dispatch(self, subject: str, message: Any) -> DispatchReply | HalfmoonError:
        try:
            return await dispatch(self.nc, subject, message, self.config.dispatch_timeout_s)
        except HalfmoonError as exc:
            return exc

    def _refusal_error(self, worker_id: str, reply: DispatchReply | HalfmoonError) -> HalfmoonError:
        reason = reply.message if isinstance(reply, HalfmoonError) else reply.reason
        self.log.info("placement.refused", worker_id=worker_id, reason=reason)
        return WorkerUnavailable(f"{worker_id} refused: {reason}")

    def _count_pending(self, worker_id: str, num_tokens: int, num_prefill_tokens: int = 0
                       ) -> None:
        """Work sent to a worker until its next heartbeat reports it: `num_tokens` of KV
        room (decode), `num_prefill_tokens` to compute (prefill)."""
        entry = self._pending[worker_id]
        block_size = self.workers.block_size(worker_id)
        num_blocks = blocks_needed(num_tokens, block_size) if num_tokens else 0
        self._pending[worker_id] = PendingWork(
            entry.num_requests + 1, entry.num_blocks + num_blocks,
            entry.num_prefill_tokens + num_prefill_tokens)

    def _count_placement(self, path: str, prefill: WorkerHeartbeat, decode: WorkerHeartbeat,
                         prefix: PrefixView | None, source: PrefixSource | None) -> None:
        """Metrics, and the decision with its inputs on the schedule span."""
        self.metrics.placements.labels(self.config.policy, path,
                                       "true" if source else "false").inc()
        if not tracing.is_enabled():
            return
        trace.get_current_span().set_attributes({
            "halfmoon.path": path,
            "halfmoon.prefill_worker": prefill.worker_id,
            "halfmoon.decode_worker": decode.worker_id,
            "halfmoon.prompt_blocks": prefix.num_blocks if prefix else 0,
            "halfmoon.cached_blocks": prefix.cached_blocks.get(prefill.worker_id, 0)
            if prefix else 0,
            "halfmoon.prefix_source": source.worker_id if source else "",
            "halfmoon.prefill_load": prefill.num_running + prefill.num_waiting,
            "halfmoon.prefill_waiting_tokens": prefill.num_waiting_tokens,
            "halfmoon.decode_free_blocks": decode.num_free_blocks,
            "halfmoon.num_prefill_candidates": len(self.workers.healthy("prefill")),
        })

    async def _reject(self, request: GenerateRequest, error: HalfmoonError) -> None:
        self.log.info("request.rejected", request_id=request.request_id, code=error.code,
                      reason=error.message)
        reason = "slo" if isinstance(error, SloViolation) else error.code.value
        self.rejections[reason] += 1
        self.metrics.rejections.labels(reason).inc()
        failure = RequestFailed(request_id=request.request_id, code=error.code,
                                message=error.message, worker_id=self.instance_id,
                                retry_after_s=error.retry_after_s)
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(request.reply_subject, encode(failure))

    async def _abort(self, request_id: str, reason: str) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(self.subjects.abort,
                                  encode(AbortRequest(request_id=request_id, reason=reason)))

    async def _stop_intake(self) -> None:
        self._is_fetching = False

    async def _drain(self) -> None:
        await self.wait_until(lambda: self._num_placing == 0)

    async def _close(self) -> None:
        # A pull subscription may hold a message delivered to a fetch that was cancelled;
        # unsubscribing hands it back to the stream (it is redelivered after ack_wait) and
        # keeps the NATS drain from waiting on it. It also ends the ordered consumer's
        # heartbeat task.
        for subscription in self._js_subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
