"""HTTP routes of the OpenAI API, on aiohttp.

Every error leaves as OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`,
with the status its typed exception carries; never a stack trace.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import structlog
from aiohttp import web
from opentelemetry.trace import SpanKind, StatusCode

from services.gateway.cors import Cors
from services.gateway.generation import Generator
from services.gateway.json_bodies import encoder, error_body, event_stream, json_response, worked_on
from services.gateway.merge import merged
from services.gateway.model_catalog import ServedModel
from services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body
from services.gateway.response_store import ResponseStore
from services.gateway.responses import (
    ChatFormat,
    Choice,
    CompletionFormat,
    ResponseFormat,
    TokenIdText,
    TokenText,
    best_choices,
    total_usage,
)
from services.gateway.responses_route import ResponsesRoutes
from services.gateway.text_chunks import TextChunk
from services.gateway.tokenize_routes import TOKENIZER_ROUTES, TokenizeRoutes
from services.gateway.tool_calls import ToolUse
from services.gateway.validation import ParsedRequest
from shared import tracing
from shared.errors import AuthenticationFailed, HalfmoonError, InvalidRequest, ModelNotFound
from shared.logs import get_logger
from shared.metrics import GatewayMetrics

log = get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class GatewayBackend(Protocol):
    """What the routes need from the gateway service."""

    api_key: str | None
    access_log: bool
    client_trace_context: bool
    cors_origins: frozenset[str]
    generator: Generator
    metrics: GatewayMetrics
    responses: ResponseStore

    async def metrics_handler(self, request: web.Request) -> web.Response: ...

    def model_list(self) -> list[dict[str, Any]]:
        """`/v1/models` entries: every model served."""

    async def served_model(self, name: str) -> ServedModel:
        """The model a request names, with its tokenizer; ModelNotFound if none serves it."""

    def parse_completion(self, request: CompletionRequest, model: ServedModel
                         ) -> list[ParsedRequest]:
        """One per prompt, in choice order."""

    def parse_chat(self, request: ChatCompletionRequest, model: ServedModel
                   ) -> list[ParsedRequest]: ...

    def render_chat(self, request: ChatCompletionRequest, model: ServedModel
                    ) -> tuple[str, ToolUse | None]:
        """A chat request's prompt text, and how its output may call its tools."""

    def health(self) -> dict[str, Any]: ...

    def check_accepting(self) -> None: ...


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except HalfmoonError as exc:
        response = json_response(error_body(exc), exc.http_status)
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        if exc.is_final:  # OpenAI's SDKs retry a 429 twice unless told not to
            response.headers["x-should-retry"] = "false"
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = InvalidRequest(f"{exc.reason}: {request.method} {request.path}")
        body = error_body(error)
        body["error"]["code"] = str(exc.status)
        return json_response(body, exc.status)
    except ConnectionResetError:
        raise  # a write found the client gone: `observe` counts it, no error of ours
    except Exception as exc:
        log.error("http.unhandled", path=request.path, exc_info=exc)
        error = HalfmoonError("internal server error")
        return json_response(error_body(error), 500)


def auth_middleware(api_key: str | None) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if api_key is not None and (request.path.startswith("/v1/")
                                    or request.path in TOKENIZER_ROUTES):
            header = request.headers.get("Authorization", "")
            token = header.removeprefix("Bearer ").strip() if header.startswith("Bearer ") else ""
            if not secrets.compare_digest(token.encode(), api_key.encode()):
                raise AuthenticationFailed("Incorrect or missing API key")
        return await handler(request)

    return check


# Each generation route and its `gen_ai.operation.name` (OpenTelemetry's GenAI conventions).
_GENERATION_ROUTES = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat",
                      "/v1/responses": "chat"}
_X_REQUEST_ID = re.compile(r"[!-~]{1,256}")  # visible ASCII: safe to send back in a header
_X_REQUEST_ID_KEY = web.RequestKey("x_request_id", str)


def x_request_id(request: web.Request) -> str:
    """The id a `/v1` response carries in `x-request-id` (as OpenAI's do): the client's own
    `X-Request-Id` when it sent one (visible ASCII, up to 256 characters), else a new one.
    The request's root span and log lines carry it too, so a client's id finds its trace."""
    value = request.get(_X_REQUEST_ID_KEY)
    if value is None:
        given = request.headers.get("X-Request-Id", "")
        value = request[_X_REQUEST_ID_KEY] = (given if _X_REQUEST_ID.fullmatch(given)
                                              else f"req-{uuid.uuid4().hex}")
    return value


async def _send_x_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if request.path.startswith("/v1/"):
        response.headers["x-request-id"] = x_request_id(request)


def observe_middleware(metrics: GatewayMetrics, *, access_log: bool = False,
                       client_trace_context: bool = True) -> Any:
    """The request's root span (`gateway.request`, the trace every other service joins; with
    `client_trace_context`, a child of the span a client's `traceparent` names), the
    request counters and, with `access_log`, one `http.request` log line when it ends (a
    stream: when its last event left), around everything else: they see the final status.

    A client that goes away is counted as 499 (nginx's code for it) and is no error of the
    server's, whether aiohttp cancelled the handler or a write found the connection closed
    first; as OpenTelemetry's HTTP conventions have it for a server span, only a 5xx sets
    the span's status to error (a 4xx is the client's)."""

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in _GENERATION_ROUTES:
            return await handler(request)
        metrics.requests_in_flight.inc()
        status = 500
        request_id = x_request_id(request)
        started = time.perf_counter()
        cancelled: asyncio.CancelledError | None = None
        client = tracing.client_context(request.headers) if client_trace_context else None
        try:
            with structlog.contextvars.bound_contextvars(x_request_id=request_id), \
                    tracing.span(__name__, "gateway.request", client, kind=SpanKind.SERVER,
                                 attributes={"http.request.method": request.method,
                                             "http.route": request.path,
                                             "gen_ai.operation.name":
                                                 _GENERATION_ROUTES[request.path],
                                             "halfmoon.x_request_id": request_id}) as span:
                try:
                    response = await handler(request)
                    status = response.status
                except asyncio.CancelledError as exc:
                    status, cancelled = 499, exc
                except ConnectionResetError:
                    status = 499
                    response = web.Response(status=status)  # reaches no one; logged as such
                finally:
                    if access_log:  # inside the span: the line carries the trace id
                        log.info("http.request", method=request.method, path=request.path,
                                 status=status,
                                 duration_ms=round((time.perf_counter() - started) * 1e3, 1))
                if span is not None:
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_attribute("error.type", str(status))
                        span.set_status(StatusCode.ERROR)
        finally:
            metrics.requests_in_flight.dec()
            metrics.requests.labels(request.path, str(status)).inc()
        if cancelled is not None:
            raise cancelled
        return response

    return observe


def build_app(backend: GatewayBackend) -> web.Application:
    cors = Cors(backend.cors_origins)
    app = web.Application(
        middlewares=[cors.preflight,
                     observe_middleware(backend.metrics, access_log=backend.access_log,
                                        client_trace_context=backend.client_trace_context),
                     error_middleware, auth_middleware(backend.api_key)],
        client_max_size=16 * 1024 * 1024,
    )
    app.on_response_prepare.append(_send_x_request_id)
    app.on_response_prepare.append(cors.on_response_prepare)
    routes = _Routes(backend)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    ResponsesRoutes(backend).add_to(app.router)
    TokenizeRoutes(backend).add_to(app.router)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)  # ids may hold "/" (org/name)
    app.router.add_get("/health", routes.health)
    app.router.add_get("/metrics", backend.metrics_handler)
    return app


class _Routes:
    def __init__(self, backend: GatewayBackend) -> None:
        self.backend = backend

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.backend.check_accepting()
        raw = await request.read()
        body = decode_body(raw, CompletionRequest)
        model = await self.backend.served_model(body.model)
        parsed = await worked_on(raw, lambda: self.backend.parse_completion(body, model))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return await _respond(request, self.backend.generator, request_id, parsed,
                              CompletionFormat(request_id, model.name, _token_text(body, model),
                                               body.logprobs is not None,
                                               bool(body.return_token_ids),
                                               body.prompt_logprobs))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.backend.check_accepting()
        raw = await request.read()
        body = decode_body(raw, ChatCompletionRequest)
        model = await self.backend.served_model(body.model)
        parsed = await worked_on(raw, lambda: self.backend.parse_chat(body, model))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await _respond(request, self.backend.generator, request_id, parsed,
                              ChatFormat(request_id, model.name, _token_text(body, model),
                                         parsed[0].sampling.logprobs is not None,
                                         bool(body.return_token_ids), body.prompt_logprobs))

    async def models(self, request: web.Request) -> web.StreamResponse:
        return json_response({"object": "list", "data": self.backend.model_list()})

    async def model(self, request: web.Request) -> web.StreamResponse:
        """One entry of `/v1/models` (OpenAI's "retrieve model")."""
        name = request.match_info["model"]
        entry = next((m for m in self.backend.model_list() if m["id"] == name), None)
        if entry is None:
            raise ModelNotFound(f"The model `{name}` does not exist", param="model")
        return json_response(entry)

    async def health(self, request: web.Request) -> web.StreamResponse:
        body = self.backend.health()
        return json_response(body, 200 if body["status"] == "ok" else 503)


def _token_text(body: CompletionRequest | ChatCompletionRequest, model: ServedModel
                ) -> TokenText:
    """How logprobs name tokens: by their text, or as `token_id:N` when asked."""
    if body.return_tokens_as_token_ids:
        return TokenIdText(model.token_text.tokenizer)
    return model.token_text


async def _respond(
    request: web.Request, generator: Generator, request_id: str, parsed: list[ParsedRequest],
    fmt: ResponseFormat,
) -> web.StreamResponse:
    # n choices per prompt; usage counts each prompt once (it is computed once).
    choices = [Choice(p.choice_index + j, 0 if j else len(p.prompt_token_ids),
                      p.prompt_token_ids, tools=p.tools)
               for p in parsed for j in range(p.sampling.n)]
    async with contextlib.aclosing(_choice_chunks(generator, request_id, parsed)) as chunks:
        if not parsed[0].is_stream:
            async for index, chunk in chunks:
                choices[index].add(chunk)
            return json_response(fmt.body(best_choices(choices, parsed), usage_of=choices))
        # Wait for the first chunk before sending headers, so that a rejection (429/503)
        # still reaches a streaming client as an HTTP status.
        first = await anext(chunks)
        response = event_stream()
        await response.prepare(request)
        await _stream_events(response, chunks, first, fmt, choices, parsed[0])
        return response


def _choice_chunks(generator: Generator, request_id: str, parsed: list[ParsedRequest]
                   ) -> AsyncIterator[tuple[int, TextChunk]]:
    """Every choice's chunks as they come, tagged with the choice's index. One prompt is one
    internal request under the response's id (its stream as it is: no layer per token in
    the way); several run side by side (so the engines batch them), each under
    `<id>-<prompt>`, and an error in one ends them all."""
    if len(parsed) == 1:
        return generator.stream(request_id, parsed[0])
    return _prompts_merged(generator, request_id, parsed)


async def _prompts_merged(generator: Generator, request_id: str, parsed: list[ParsedRequest]
                          ) -> AsyncIterator[tuple[int, TextChunk]]:
    streams = [generator.stream(f"{request_id}-{i}", p) for i, p in enumerate(parsed)]
    async for prompt, (choice, chunk) in merged(streams):
        yield parsed[prompt].choice_index + choice, chunk


async def _stream_events(
    response: web.StreamResponse, chunks: AsyncIterator[tuple[int, TextChunk]],
    first: tuple[int, TextChunk], fmt: ResponseFormat, choices: list[Choice],
    parsed: ParsedRequest,
) -> None:
    include_usage = parsed.include_usage or parsed.usage_on_every_chunk

    async def send(index: int, chunk: TextChunk) -> None:
        choice = choices[index]
        choice.add(chunk, keeps_output=False)
        # With `continuous_usage_stats`, every chunk says the usage so far.
        extra = ({"usage": total_usage(choices) if parsed.usage_on_every_chunk else None}
                 if include_usage else {})
        # A choice's first chunk comes after its opening (chat's role chunk).
        if choice.num_chunks == 1 and (opening := fmt.opening(choice)) is not None:
            await _send(response, {**opening, **extra})
        if (body := fmt.chunk(choice, chunk)) is not None:
            await _send(response, {**body, **extra})

    try:
        await send(*first)
        async for index, chunk in chunks:
            await send(index, chunk)
        if include_usage:
            await _send(response, fmt.usage_chunk(total_usage(choices)))
    except HalfmoonError as exc:
        await _send(response, error_body(exc))
    await response.write(b"data: [DONE]\n\n")


async def _send(response: web.StreamResponse, body: dict[str, Any]) -> None:
    await response.write(b"data: " + encoder.encode(body) + b"\n\n")
