"""From a validated request to a stream of text: publish, follow, detokenize, stop.

`Generator.stream` yields `TextChunk`s. Leaving the iteration early for any reason (client
gone, stop string, error) publishes an `AbortRequest`, so every block downstream is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from services.gateway.merge import merged
from services.gateway.request_progress import Progress, TokenClock
from services.gateway.request_stream import RequestStream, StreamTable
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.text_chunks import PendingChunk, TextChunk
from services.gateway.tokenizer import Tokenizer
from services.gateway.validation import ParsedRequest
from shared import tracing
from shared.errors import (
    HalfmoonError,
    RequestMoved,
    RequestTooLarge,
    WorkerLost,
    WorkerUnavailable,
)
from shared.events import EventPublisher
from shared.jetstream_assets import Redeclare, publish_to_stream
from shared.logs import get_logger
from shared.messages import (
    AbortRequest,
    GenerateRequest,
    TokenLogprob,
    choice_id,
)
from shared.metrics import GatewayMetrics
from shared.nats_client import encode
from shared.subjects import Subjects
from shared.token_batches import is_prompt_piece

log = get_logger(__name__)

# What the conductor's commands add around a `GenerateRequest` (`PrefillTask`,
# `DecodeReservation`: a worker id, a few numbers) and the headers it travels with.
_COMMAND_WRAPPING_BYTES = 4096

# Requests being queued (published into the request stream, its acknowledgement awaited) at
# once; the rest wait their turn. A burst of thousands, all waiting, kept this process so busy
# that acknowledgements already in its socket were read after their 2 s wait had run out, and
# each retry added to the pile: past 15 s of them the request got a 503.
MAX_QUEUEING = 512
# How long a request its client left waits for its message to be taken out of the queue.
UNQUEUE_WITHIN_S = 1.0


@dataclass(frozen=True)
class GeneratorContext:
    nc: NatsClient
    js: JetStreamContext
    subjects: Subjects
    reply_subject: str
    table: StreamTable
    tokenizer_of: Callable[[str], Tokenizer]  # by model
    timeout_s: float
    metrics: GatewayMetrics
    events: EventPublisher
    redeclare_requests: Redeclare | None = None  # the request stream, when it is gone
    status_subject: str = ""  # where this gateway answers `StreamQuery`, `OpenStreamsQuery`
    queueing: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(MAX_QUEUEING))


class Generator:
    def __init__(self, context: GeneratorContext) -> None:
        self._ctx = context

    async def stream(self, request_id: str, parsed: ParsedRequest
                     ) -> AsyncIterator[tuple[int, TextChunk]]:
        """The request's chunks, each with its choice (0..n-1). Published once; for n > 1
        each choice streams, stops and fails over under its own id (`choice_id`)."""
        ctx = self._ctx
        n = parsed.sampling.n
        ids = [choice_id(request_id, j, n) for j in range(n)]
        streams = ctx.table.open_group(request_id, ids)
        # Latencies are the request's: its first choice's; every choice's tokens count.
        clocks = [TokenClock(ctx.metrics, observes_latency=j == 0) for j in range(n)]
        progress = [Progress() for _ in range(n)]
        error: HalfmoonError | None = None
        span = trace.get_current_span()  # the request's root span, when tracing
        _describe(span, request_id, parsed)
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            # Before the request is queued: every other event of it comes after this one.
            await ctx.events.request("accepted", request_id, model=parsed.model,
                                     num_prompt_tokens=len(parsed.prompt_token_ids),
                                     priority=parsed.priority)
            queued_seq = await self._publish(request_id, parsed, [], attempt=0)
            for stream in streams:
                stream.queued_seq = queued_seq
            if n == 1:  # no layer per token in the way
                async for chunk in self._follow(request_id, parsed, streams[0], clocks[0],
                                                progress[0]):
                    yield 0, chunk
            else:
                async for item in merged([
                    self._follow(ids[j], self._choice(parsed, j), streams[j], clocks[j],
                                 progress[j]) for j in range(n)
                ]):
                    yield item
        except HalfmoonError as exc:
            error = exc
            # A stream's HTTP status (200) went out before it: the span says it failed.
            span.set_status(StatusCode.ERROR, f"{type(exc).__name__}: {exc.message}")
            raise
        finally:
            # Every choice's tokens, finished or not (a client that left was sent some).
            span.set_attribute("gen_ai.usage.output_tokens",
                               sum(len(p.generated) for p in progress))
            structlog.contextvars.unbind_contextvars("request_id")
            ctx.table.close_group(request_id)
            open_choices = [j for j in range(n) if progress[j].finish_reason is None]
            for j in open_choices if n > 1 else []:
                await self._abort(ids[j])
            if open_choices:
                await self._abort(request_id)
                await self._unqueue([streams[j] for j in open_choices])
            for j in range(n):
                clocks[j].finish()
                await self._report_end(ids[j], parsed, streams[j], clocks[j], progress[j],
                                       error)

    @staticmethod
    def _choice(parsed: ParsedRequest, choice: int) -> ParsedRequest:
        """Choice `choice` of an n > 1 request as a request of its own (its continuation
        after a lost worker): n = 1, drawing from `seed + choice`."""
        if parsed.sampling.n == 1:
            return parsed
        seed = None if parsed.sampling.seed is None else parsed.sampling.seed + choice
        return dataclasses.replace(parsed, sampling=msgspec.structs.replace(
            parsed.sampling, n=1, seed=seed))

    async def _follow(self, request_id: str, parsed: ParsedRequest, stream: RequestStream,
                      clock: TokenClock, progress: Progress) -> AsyncIterator[TextChunk]:
        """Token deltas of one choice in order, detokenized and stop-matched, failing over
        lost workers."""
        ctx = self._ctx
        span = trace.get_current_span()
        detokenizer = ctx.tokenizer_of(parsed.model).detokenizer(
            skip_special_tokens=parsed.skip_special_tokens)
        matcher = StopStringMatcher(parsed.stop,
                                    include_stop=parsed.include_stop_str_in_output)
        generated = progress.generated
        pending = PendingChunk(parsed)
        scored_prompt: list[TokenLogprob] = []  # pieces of a long prompt's logprobs
        attempt = 0
        while True:
            try:
                delta = await stream.next(ctx.timeout_s)
            except WorkerLost as exc:
                if not progress.may_continue_after(exc):
                    raise
                attempt += 1
                await self._place_again(request_id, parsed, stream, exc, generated,
                                        attempt=attempt)
                scored_prompt = []  # the new attempt sends its own
                continue
            if is_prompt_piece(delta):  # ahead of the first token (`shared.token_batches`)
                scored_prompt += delta.prompt_logprobs or []
                continue
            if scored_prompt:
                delta = msgspec.structs.replace(
                    delta, prompt_logprobs=scored_prompt + (delta.prompt_logprobs or []))
                scored_prompt = []
            clock.tick(len(delta.token_ids))
            is_first = not generated
            if is_first:
                progress.num_cached = delta.num_cached_tokens
                span.add_event("first_token", {"halfmoon.cached_tokens": progress.num_cached})
                pending.add_prompt(delta)
            if parsed.is_prompt_only:  # `echo` with `max_tokens: 0`: the prompt alone
                progress.finish_reason = "length"
                ctx.metrics.prompt_tokens.inc(len(parsed.prompt_token_ids))
                yield pending.take("", "length", 0, progress.num_cached)
                return
            generated += delta.token_ids
            pending.add(delta)
            text = matcher.push(detokenizer.push(delta.token_ids))
            finish = delta.finish_reason
            if finish is not None and not matcher.is_stopped:
                text += matcher.push(detokenizer.flush())
                text += matcher.flush()
            if matcher.is_stopped:
                finish = "stop"
            if text or finish is not None:
                yield pending.take(text, finish, len(generated), progress.num_cached)
            if is_first:  # once the client has it: the event is off the TTFT path
                await ctx.events.request("first_token", request_id, model=parsed.model,
                                         num_cached_tokens=progress.num_cached,
                                         ttft_s=clock.timings()["ttft_s"],
                                         **progress.workers(stream))
            if finish is not None:
                progress.finish_reason = finish
                ctx.metrics.prompt_tokens.inc(len(parsed.prompt_token_ids))
                ctx.metrics.cached_prompt_tokens.inc(progress.num_cached)
                if delta.finish_reason is None:  # a stop string: decode still runs
                    await self._abort(request_id)
                return

    async def _place_again(self, request_id: str, parsed: ParsedRequest,
                           stream: RequestStream, exc: WorkerLost, generated: list[int], *,
                           attempt: int) -> None:
        """A worker of the choice was lost (or shed it): its continuation, from the tokens
        `generated` so far, queued as attempt `attempt`, said in its trace and events."""
        ctx = self._ctx
        is_moved = isinstance(exc, RequestMoved)  # shed by a busy worker, not lost
        (log.info if is_moved else log.warning)(
            "request.moved" if is_moved else "request.failover", request_id=request_id,
            error=exc.message, num_streamed=len(generated), attempt=attempt)
        if not is_moved:
            ctx.metrics.failovers.inc()
        trace.get_current_span().add_event("migrated", {
            "halfmoon.attempt": attempt, "halfmoon.lost_worker": exc.worker_id,
            "halfmoon.output_tokens": len(generated), "halfmoon.error": exc.message})
        # Before the continuation is queued: its `placed` event comes after this one.
        await ctx.events.request("migrated", request_id, model=parsed.model,
                                 attempt=attempt, num_output_tokens=len(generated),
                                 lost_worker_id=exc.worker_id, error=exc.message)
        stream.attempt = attempt
        # What the attempt before left running (a prefill worker still holding its KV, a
        # decode worker that was only slow) stops before this one is placed: a worker sees
        # one attempt of a request at a time.
        await self._abort(request_id, "placed again", attempt=attempt)
        stream.queued_seq = await self._publish(request_id, parsed, generated, attempt=attempt)

    async def _report_end(self, request_id: str, parsed: ParsedRequest, stream: RequestStream,
                          clock: TokenClock, progress: Progress,
                          error: HalfmoonError | None) -> None:
        """The request's last public event: finished (or aborted by its client) or failed."""
        common = {"model": parsed.model, "num_prompt_tokens": len(parsed.prompt_token_ids),
                  "num_cached_tokens": progress.num_cached,
                  "num_output_tokens": len(progress.generated), "priority": parsed.priority,
                  **progress.workers(stream)}
        timings = clock.timings()
        if error is not None:
            await self._ctx.events.request("failed", request_id, error_code=error.code.value,
                                           error=error.message, e2e_s=timings["e2e_s"],
                                           **common)
            return
        await self._ctx.events.request("finished", request_id,
                                       finish_reason=progress.finish_reason or "abort",
                                       **common, **timings)

    async def _publish(self, request_id: str, parsed: ParsedRequest, generated: list[int],
                       *, attempt: int) -> int:
        """Queue the request; after a lost worker, a continuation: the prompt plus what was
        already streamed, for the tokens still owed, numbered on from there. Returns the
        message's sequence in the request stream."""
        ctx = self._ctx
        sampling = msgspec.structs.replace(
            parsed.sampling, max_tokens=parsed.sampling.max_tokens - len(generated))
        if generated:  # the prompt's logprobs went out with the first token
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        message = GenerateRequest(
            request_id=request_id, model=parsed.model,
            prompt_token_ids=parsed.prompt_token_ids + generated, sampling=sampling,
            reply_subject=ctx.reply_subject, created_at_s=time.time(),
            output_offset=len(generated), attempt=attempt, status_subject=ctx.status_subject,
            priority=parsed.priority, wait_s=ctx.timeout_s,
        )
        payload = encode(message)
        if len(payload) + _COMMAND_WRAPPING_BYTES > ctx.nc.max_payload:
            raise RequestTooLarge(
                f"the request's {len(message.prompt_token_ids):,} tokens make a "
                f"{len(payload):,}-byte message, over the {ctx.nc.max_payload:,} bytes this "
                "cluster's message bus carries in one (the NATS server's max_payload, less "
                f"{_COMMAND_WRAPPING_BYTES:,} for the commands that carry it on): shorten "
                "the prompt, or raise max_payload")
        message_id = request_id if attempt == 0 else f"{request_id}/{attempt}"
        try:
            async with ctx.queueing:
                queued = await publish_to_stream(ctx.js, ctx.subjects.requests, payload,
                                                 msg_id=message_id, headers=tracing.inject(),
                                                 redeclare=ctx.redeclare_requests)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise WorkerUnavailable(f"cannot queue the request: {str(exc) or repr(exc)}") from exc
        return queued.seq

    async def _unqueue(self, streams: list[RequestStream]) -> None:
        """Take the requests of `streams` that no conductor placed yet out of the request
        stream. Their abort reaches only the conductors up now: one that starts later (a
        restart, the last one back after an outage) would place them for no one, and a
        backlog of them would hold up the requests still waited for. A message a conductor
        took meanwhile is gone already (the delete finds nothing) or in its hands (the abort
        drops it). The stream is on disk and its sequences never repeat, so a sequence
        names this request's message and no other's."""
        ctx = self._ctx
        for seq in {s.queued_seq for s in streams
                    if s.placement is None and s.queued_seq is not None}:
            try:
                async with asyncio.timeout(UNQUEUE_WITHIN_S):
                    await ctx.js.delete_msg(ctx.subjects.requests_stream, seq)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                pass  # placed meanwhile, or the bus does not answer: the abort stands

    async def _abort(self, request_id: str, reason: str = "gateway", *,
                     attempt: int = 0) -> None:
        """Every worker drops the request, and without `attempt` every conductor (it is
        ended: not placed again); with `attempt`, the request is placed again as that
        attempt, and a late command of an earlier one is refused."""
        abort = AbortRequest(request_id=request_id, reason=reason, attempt=attempt,
                             before_delivery=1 if attempt else 0, is_ended=not attempt)
        try:
            await self._ctx.nc.publish(self._ctx.subjects.abort, encode(abort))
        except nats.errors.Error as exc:
            log.warning("abort.publish_failed", request_id=request_id, error=repr(exc))


def _describe(span: trace.Span, request_id: str, parsed: ParsedRequest) -> None:
    """The request on its root span: what OpenTelemetry's GenAI conventions name, by their
    names (trace UIs and queries know them, as they do vLLM's); halfmoon's own under
    `halfmoon.`."""
    span.set_attributes({"halfmoon.request_id": request_id,
                         "gen_ai.request.model": parsed.model,
                         "gen_ai.request.max_tokens": parsed.sampling.max_tokens,
                         "gen_ai.usage.input_tokens": len(parsed.prompt_token_ids)})
    if parsed.priority:
        span.set_attribute("halfmoon.priority", parsed.priority)
