"""A request delivered to a conductor again: placed already, or not?

JetStream delivers a request again when the delivery before was not acked within
`ack_wait`: its conductor died or was cut off, or the ack was lost on its way, possibly
after the request's commands had gone out and it was running. Placed again blindly, it
ran twice: two decode workers streaming one request, each using blocks and steps, their
tokens mixed at the gateway. (A held request, nak'ed on purpose, is delivered again too.)
So before placing a delivery after the first, the conductor asks the request's gateway
(`StreamQuery`), which knows whether a client still waits, which attempt its stream
follows, whether that placement reached it and how much it has streamed; `next_step`
decides from the answer (pure, tested without NATS); `Redeliveries` acts on it.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from services.conductor import holding
from services.conductor.placer import Abort, Lapsed
from shared.errors import ErrorCode, WorkerUnavailable
from shared.logs import get_logger
from shared.messages import GenerateRequest, RequestFailed, StreamQuery, StreamStatus
from shared.metrics import ConductorMetrics
from shared.nats_client import NatsClient, ask_stream_status

ASK_AGAIN_S = 1.0  # a silent gateway is asked again this much later
# A gateway answers from memory at once; a fetcher waits this long at most on one gone quiet.
ANSWER_WITHIN_S = 0.5

log = get_logger(__name__)


class Step(enum.Enum):
    PLACE = "place"  # not placed: abort what a cut-short placement left, then place it
    PLACE_UNASKED = "place_unasked"  # the gateway cannot tell (it is too old, or silent)
    DONE = "done"  # placed already, or the gateway placed it again itself: ack only
    DROP = "drop"  # no client waits for it: abort it, ack
    MOVE = "move"  # it streams from a placement the gateway never heard of: abort that,
    #                and have the gateway place the rest as a continuation
    ASK_LATER = "ask_later"  # no answer: deliver it again shortly


class HeldHere:
    """Requests this conductor held (nak'ed with a delay) after aborting every side it had
    placed: a delivery of one of them that comes back here needs no question (with one
    conductor, every held request's does). Bounded: the oldest are forgotten first."""

    def __init__(self, max_entries: int = 100_000) -> None:
        self._max_entries = max_entries
        self._ids: dict[str, None] = {}  # insertion-ordered

    def note(self, request_id: str) -> None:
        self._ids.pop(request_id, None)
        self._ids[request_id] = None
        if len(self._ids) > self._max_entries:
            del self._ids[next(iter(self._ids))]

    def take(self, request_id: str) -> bool:
        """Whether this conductor held the request (and forget it)."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True


class Redeliveries:
    """Settles the deliveries after the first that are not to be placed, and aborts what an
    earlier placement of those that are may have left."""

    def __init__(self, metrics: ConductorMetrics, abort: Abort,
                 tell_gateway: Callable[[GenerateRequest, RequestFailed], Awaitable[None]]
                 ) -> None:
        self.metrics = metrics
        self.abort = abort
        self.tell_gateway = tell_gateway
        self.held = HeldHere()

    async def may_place(self, nc: NatsClient, request: GenerateRequest, msg: Msg,
                        is_lapsed: Callable[[], bool]) -> bool:
        """Whether to place this delivery; if not, it is settled here. Raises `Lapsed` when
        it lapsed while the gateway answered (its abort would reach the next delivery's
        sides)."""
        if self.held.take(request.request_id):  # after aborting its sides: none runs
            self.metrics.deliveries_again.labels("held_here").inc()
            return True
        step = Step.PLACE_UNASKED  # a gateway too old to be asked
        if request.status_subject:
            status = await ask_gateway(nc, request)
            step = next_step(status, num_delivered=msg.metadata.num_delivered,
                             output_offset=request.output_offset)
            if is_lapsed():
                raise Lapsed
        log.info("request.delivered_again", request_id=request.request_id,
                 num_delivered=msg.metadata.num_delivered, step=step.value)
        self.metrics.deliveries_again.labels(step.value).inc()
        if step in (Step.PLACE, Step.DROP, Step.MOVE):  # what an earlier placement left
            await self.abort(request.request_id, f"delivered again: {step.value}",
                             attempt=request.attempt, before_delivery=msg.metadata.num_delivered)
        if step is Step.MOVE:  # naming no worker: never stale
            await self.tell_gateway(request, RequestFailed(
                request_id=request.request_id, code=ErrorCode.MOVED,
                message="placed again after its conductor was lost"))
        if step is Step.ASK_LATER:
            await msg.nak(delay=ASK_AGAIN_S)
        elif step not in (Step.PLACE, Step.PLACE_UNASKED):
            await msg.ack()
        return step in (Step.PLACE, Step.PLACE_UNASKED)


def next_step(status: StreamStatus | None, *, num_delivered: int, output_offset: int) -> Step:
    """What to do with a delivery after the first, from the gateway's answer (None: no
    answer; a gateway cut off from us gets until the request's last delivery). A
    continuation's first `output_offset` tokens came from the attempts before it, and the
    first token of this one may come from a prefill whose decode side refused (the request
    was then held, its sides aborted): only tokens past it say a decode worker streams."""
    if status is None:
        return Step.ASK_LATER if num_delivered < holding.MAX_DELIVER - 1 else Step.PLACE_UNASKED
    if not status.is_open:
        return Step.DROP
    if not status.is_current or status.is_placed:
        return Step.DONE
    if status.num_streamed > output_offset + 1:
        return Step.MOVE
    return Step.PLACE


async def ask_gateway(nc: NatsClient, request: GenerateRequest) -> StreamStatus | None:
    """The request's gateway's answer to `StreamQuery`; None when it gives none."""
    query = StreamQuery(request_id=request.request_id, attempt=request.attempt)
    try:
        return await ask_stream_status(nc, request.status_subject, query, ANSWER_WITHIN_S)
    except WorkerUnavailable as exc:
        log.info("request.gateway_silent", request_id=request.request_id, error=exc.message)
        return None


def span_attributes(request: GenerateRequest, msg: Msg) -> dict[str, int]:
    """Span attributes of a placement after the first: which attempt of the request (a
    continuation after a lost worker), and which delivery of it (JetStream's again)."""
    attributes = {}
    if request.attempt:
        attributes["halfmoon.attempt"] = request.attempt
        attributes["halfmoon.output_offset"] = request.output_offset
    if msg.metadata.num_delivered > 1:
        attributes["halfmoon.num_delivered"] = msg.metadata.num_delivered
    return attributes
