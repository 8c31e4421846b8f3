"""From a validated request to a stream of text: publish, follow, detokenize, stop.

`Generator.stream` yields `TextChunk`s. Leaving the iteration early for any reason (client
gone, stop string, error) publishes an `AbortRequest`, so every block downstream is freed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from opentelemetry import trace

from services.gateway.openai_schema import ParsedRequest
from services.gateway.request_stream import StreamTable
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import Tokenizer
from shared import tracing
from shared.errors import WorkerLost, WorkerUnavailable
from shared.logs import get_logger
from shared.messages import AbortRequest, FinishReason, GenerateRequest
from shared.metrics import GatewayMetrics
from shared.nats_client import encode
from shared.subjects import Subjects

log = get_logger(__name__)

# Continuations per request after lost workers; past this the client gets the error.
MAX_FAILOVERS = 2


@dataclass(frozen=True)
class TextChunk:
    text: str
    finish_reason: FinishReason | None
    num_completion_tokens: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (first placement)


@dataclass(frozen=True)
class GeneratorContext:
    nc: NatsClient
    js: JetStreamContext
    subjects: Subjects
    reply_subject: str
    table: StreamTable
    tokenizer: Tokenizer
    timeout_s: float
    metrics: GatewayMetrics


class _TokenClock:
    """TTFT, inter-token latency and end-to-end latency of one request, as the client sees
    them (tokens leave the gateway as they arrive)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.started_at = time.perf_counter()
        self.last_at: float | None = None

    def tick(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if self.last_at is None:
            self.metrics.ttft.observe(now - self.started_at)
        else:
            self.metrics.itl.observe(now - self.last_at)
        self.metrics.generation_tokens.inc(num_tokens)
        self.last_at = now

    def finish(self) -> None:
        if self.last_at is not None:
            self.metrics.e2e.observe(self.last_at - self.started_at)


class Generator:
    def __init__(self, context: GeneratorContext) -> None:
        self._ctx = context

    async def stream(self, request_id: str, parsed: ParsedRequest) -> AsyncIterator[TextChunk]:
        ctx = self._ctx
        stream = ctx.table.open(request_id)
        is_done = False
        clock = _TokenClock(ctx.metrics)
        span = trace.get_current_span()  # the request's root span, when tracing
        span.set_attributes({"halfmoon.request_id": request_id,
                             "halfmoon.prompt_tokens": len(parsed.prompt_token_ids),
                             "halfmoon.max_tokens": parsed.sampling.max_tokens})
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            await self._publish(request_id, parsed, [], attempt=0)
            detokenizer = ctx.tokenizer.detokenizer()
            matcher = StopStringMatcher(parsed.stop)
            generated: list[int] = []
            num_cached = 0
            attempt = 0
            while not is_done:
                try:
                    delta = await stream.next(ctx.timeout_s)
                except WorkerLost as exc:
                    attempt += 1
                    if attempt > MAX_FAILOVERS:
                        raise
                    log.warning("request.failover", request_id=request_id, error=exc.message,
                                num_streamed=len(generated), attempt=attempt)
                    await self._publish(request_id, parsed, generated, attempt=attempt)
                    continue
                if not generated:
                    num_cached = delta.num_cached_tokens
                    span.add_event("first_token", {"halfmoon.cached_tokens": num_cached})
                clock.tick(len(delta.token_ids))
                generated += delta.token_ids
                text = matcher.push(detokenizer.push(delta.token_ids))
                finish = delta.finish_reason
                if finish is not None and not matcher.is_stopped:
                    text += matcher.push(detokenizer.flush())
                    text += matcher.flush()
                if matcher.is_stopped:
                    finish = "stop"
                is_done = finish is not None and delta.finish_reason is not None
                if text or finish is not None:
                    yield TextChunk(text, finish, len(generated), num_cached)
                if finish is not None:
                    ctx.metrics.prompt_tokens.inc(len(parsed.prompt_token_ids))
                    ctx.metrics.cached_prompt_tokens.inc(num_cached)
                    span.set_attribute("halfmoon.completion_tokens", len(generated))
                    return
        finally:
            clock.finish()
            structlog.contextvars.unbind_contextvars("request_id")
            ctx.table.close(request_id)
            if not is_done:
                await self._abort(request_id)

    async def _publish(self, request_id: str, parsed: ParsedRequest, generated: list[int],
                       *, attempt: int) -> None:
        """Queue the request; after a lost worker, a continuation: the prompt plus what was
        already streamed, for the tokens still owed, numbered on from there."""
        ctx = self._ctx
        sampling = msgspec.structs.replace(
            parsed.sampling, max_tokens=parsed.sampling.max_tokens - len(generated))
        message = GenerateRequest(
            request_id=request_id, model=parsed.model,
            prompt_token_ids=parsed.prompt_token_ids + generated, sampling=sampling,
            reply_subject=ctx.reply_subject, created_at_s=time.time(),
            output_offset=len(generated),
        )
        message_id = request_id if attempt == 0 else f"{request_id}/{attempt}"
        try:
            await ctx.js.publish(ctx.subjects.requests, encode(message),
                                 headers={"Nats-Msg-Id": message_id, **(tracing.inject() or {})})
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise WorkerUnavailable(f"cannot queue the request: {exc!r}") from exc

    async def _abort(self, request_id: str) -> None:
        try:
            await self._ctx.nc.publish(
                self._ctx.subjects.abort,
                encode(AbortRequest(request_id=request_id, reason="gateway")),
            )
        except nats.errors.Error as exc:
            log.warning("abort.publish_failed", request_id=request_id, error=repr(exc))
