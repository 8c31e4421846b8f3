"""What the conductor sends: commands to workers, word to a request's gateway, aborts, and
the public `placed` and `migrated` events, over the conductor's connection as it is when
called (the outbox is made before the conductor connects). A command's missing reply comes
back as the error saying why; an abort or a failure sent to a gateway is let go when the bus
cannot take it (the next delivery aborts again; a gateway that hears nothing asks)."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import nats.errors

from services.conductor.assignment import Plan
from shared.errors import HalfmoonError
from shared.events import EventPublisher
from shared.messages import (
    AbortRequest,
    DecodeReplacement,
    DispatchReply,
    GenerateRequest,
    RequestFailed,
    RequestPlaced,
)
from shared.metrics import ConductorMetrics
from shared.nats_client import NatsClient, dispatch, encode
from shared.subjects import Subjects


class Connected(Protocol):
    """The conductor service, as far as sending goes."""

    subjects: Subjects

    @property
    def nc(self) -> NatsClient: ...

    @property
    def events(self) -> EventPublisher: ...


class Outbox:
    def __init__(self, sender: Connected, metrics: ConductorMetrics,
                 dispatch_timeout_s: float) -> None:
        self._sender = sender
        self._metrics = metrics
        self._dispatch_timeout_s = dispatch_timeout_s

    async def dispatch(self, subject: str, message: Any,
                       trace_headers: dict[str, str] | None = None
                       ) -> DispatchReply | HalfmoonError:
        """A command to one worker: its reply, or why none came."""
        try:
            return await dispatch(self._sender.nc, subject, message, self._dispatch_timeout_s,
                                  trace_headers=trace_headers)
        except HalfmoonError as exc:
            return exc

    async def abort(self, request_id: str, reason: str, worker_id: str = "", *,
                    attempt: int = 0, before_delivery: int = 0) -> None:
        """Every worker (or only `worker_id`) drops the request and frees its blocks; with
        `before_delivery`, refuses that attempt's commands of earlier deliveries still on
        their way (`services/superseded.py`)."""
        with contextlib.suppress(nats.errors.Error):
            await self._sender.nc.publish(self._sender.subjects.abort, encode(AbortRequest(
                request_id=request_id, reason=reason, worker_id=worker_id, attempt=attempt,
                before_delivery=before_delivery)))

    async def announce(self, request: GenerateRequest, chosen: Plan, placement_s: float, *,
                       delivery: int) -> None:
        """Tell the request's gateway, and anyone listening, where it runs."""
        self._metrics.placement_seconds.observe(placement_s)
        await self.tell_placed(request, chosen, delivery)
        await self._sender.events.request(
            "placed", request.request_id, model=request.model,
            num_prompt_tokens=len(request.prompt_token_ids),
            prefill_worker_id=chosen.prefill.worker_id,
            decode_worker_id=chosen.decode.worker_id, placement_s=placement_s,
            path=chosen.path)

    async def tell_placed(self, request: GenerateRequest, chosen: Plan,
                          delivery: int = 0) -> None:
        await self._sender.nc.publish(request.reply_subject, encode(RequestPlaced(
            request_id=request.request_id, prefill_worker_id=chosen.prefill.worker_id,
            decode_worker_id=chosen.decode.worker_id,
            prefill_started_at_s=chosen.prefill.started_at_s,
            decode_started_at_s=chosen.decode.started_at_s, attempt=request.attempt,
            delivery=delivery)))

    async def tell_migrated(self, replacement: DecodeReplacement, chosen: Plan) -> None:
        """The public `migrated` event: the request's decode side moved, and why."""
        request = replacement.request
        await self._sender.events.request(
            "migrated", request.request_id, model=request.model,
            prefill_worker_id=replacement.prefill_worker_id,
            decode_worker_id=chosen.decode.worker_id,
            lost_worker_id=replacement.failed_decode_worker_id, error=replacement.reason)

    async def tell_gateway(self, request: GenerateRequest, failure: RequestFailed) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._sender.nc.publish(request.reply_subject, encode(failure))
