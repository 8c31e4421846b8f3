"""The gateway service: OpenAI HTTP in front, NATS behind.

Lifecycle: start() declares the request stream, subscribes to its own reply subject and to
worker heartbeats (for /health), then opens the HTTP port. stop() refuses new requests (503),
lets streams in flight finish up to `drain_timeout_s`, then closes the HTTP server; requests
still open at that point get an error event and their downstream work is aborted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import nats.errors
from aiohttp import web
from nats.js.kv import KeyValue

from services.gateway.api import build_app
from services.gateway.cors import parse_origins
from services.gateway.generation import Generator, GeneratorContext
from services.gateway.model_catalog import ModelCatalog, ServedModel
from services.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationParams,
    chat_messages,
    chat_tools,
    completion_prompts,
)
from services.gateway.request_stream import StreamTable
from services.gateway.response_store import ResponseStore
from services.gateway.structured import check_grammar
from services.gateway.token_filters import bad_word_sequences
from services.gateway.tokenizer import Tokenizer
from services.gateway.tool_calls import ToolUse, tool_format
from services.gateway.validation import (
    Output,
    ParsedRequest,
    chat_output,
    completion_output,
    validate,
)
from shared.config import GatewayConfig
from shared.errors import (
    ConfigError,
    RequestAborted,
    UnsupportedParameter,
    WorkerUnavailable,
)
from shared.heartbeats import WorkerDirectory
from shared.jetstream_assets import Redeclare, ensure_bucket, ensure_work_queue, read_registry
from shared.messages import (
    GatewayEvent,
    OpenStreams,
    OpenStreamsQuery,
    ResumePoint,
    StreamQuery,
    StreamResume,
    StreamStatus,
    WorkerHeartbeat,
)
from shared.metrics import GatewayMetrics
from shared.nats_client import encode
from shared.service import Service

# OpenAI's legacy completions endpoint defaults to 16 new tokens; chat fills the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# A stream with no placement and no token is asked for among every decode worker after this
# many `resume_after_s`: it usually waits in the queue (placement not lost, only not made).
UNPLACED_RESUME_FACTOR = 4
RESUME_POINTS_PER_MESSAGE = 2000  # under 200 KB: within any NATS server's max_payload


class GatewayService(Service):
    name = "gateway"
    metrics_type = GatewayMetrics
    serves_own_metrics = False  # /metrics is a route of the API
    metrics: GatewayMetrics

    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer | None = None) -> None:
        super().__init__(config)
        self.config: GatewayConfig = config
        self.gateway_id = config.gateway_id or f"gw-{uuid.uuid4().hex[:12]}"
        self._tokenizer = tokenizer
        self.api_key = config.api_key
        self.access_log = config.access_log
        self.client_trace_context = config.client_trace_context
        self.cors_origins = parse_origins(config.cors_origins)
        self.table = StreamTable()
        self.workers = WorkerDirectory(timeout_s=config.heartbeat_timeout_s)
        self.catalog: ModelCatalog | None = None
        self.port: int | None = None
        self._generator: Generator | None = None
        self.responses = ResponseStore(None)  # stored responses: in NATS KV once started
        self._runner: web.AppRunner | None = None
        self._is_accepting = False
        self._created = int(time.time())  # each model's `created` in /v1/models: stable

    @property
    def instance_id(self) -> str:
        return self.gateway_id

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            raise WorkerUnavailable("gateway is not started")
        return self._generator

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def models(self) -> ModelCatalog:
        if self.catalog is None:
            raise WorkerUnavailable("gateway is not started")
        return self.catalog

    async def _setup(self) -> None:
        self.catalog = ModelCatalog(self.config, self.workers, self._tokenizer,
                                    self._read_template())
        await self.catalog.start()
        js = self.nc.jetstream()

        def declare_requests() -> Awaitable[None]:
            return ensure_work_queue(js, self.subjects.requests_stream, self.subjects.requests,
                                     max_age_s=self.config.request_timeout_s,
                                     replicas=self.config.js_replicas)

        await declare_requests()
        reply_subject = self.subjects.gateway(self.gateway_id)
        await self.serve(reply_subject, GatewayEvent, self._on_event)
        status_subject = self.subjects.gateway_status(self.gateway_id)
        await self.serve(status_subject, StreamQuery | OpenStreamsQuery, self._on_status_query)
        await self.serve(self.subjects.all_heartbeats, WorkerHeartbeat, self._on_heartbeat)
        for heartbeat in await read_registry(self.nc.jetstream(), self.subjects.workers_bucket):
            self._observe(heartbeat, from_registry=True)

        def declare_responses() -> Awaitable[KeyValue]:
            return ensure_bucket(js, self.subjects.responses_bucket, self.config.responses_ttl_s,
                                 replicas=self.config.js_replicas,
                                 max_bytes=self.config.responses_max_bytes)

        self.responses = ResponseStore(
            await declare_responses(), Redeclare(declare_responses, "the stored-responses bucket")
        ) if self.config.responses_ttl_s > 0 else ResponseStore(None)
        self._generator = Generator(GeneratorContext(
            nc=self.nc, js=js, subjects=self.subjects, reply_subject=reply_subject,
            table=self.table, tokenizer_of=self._tokenizer_of,
            timeout_s=self.config.request_timeout_s, metrics=self.metrics, events=self.events,
            redeclare_requests=Redeclare(declare_requests, "the request stream"),
            status_subject=status_subject,
        ))
        await self._serve_http()
        self.spawn(self._watch_workers(), "watch-workers")
        self._is_accepting = True

    def _tokenizer_of(self, model: str) -> Tokenizer:
        """The tokenizer of a model a request was parsed for (so: loaded)."""
        served = self.models.loaded(model)
        if served is None:
            raise WorkerUnavailable(f"the model `{model}` is not loaded")
        return served.tokenizer

    def _read_template(self) -> str | None:
        path = self.config.chat_template_path
        if path is None:
            return None
        try:
            return Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read chat template {path}: {exc}") from exc

    async def _serve_http(self) -> None:
        self._runner = web.AppRunner(build_app(self), handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        sock = socket.create_server((self.config.host, self.config.port), reuse_port=False)
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def _watch_workers(self) -> None:
        """Fail over requests whose worker stopped heartbeating while our NATS server answers
        us (their readers place them again as continuations); ask decode workers to resend
        what stalled streams may have lost, and every decode worker where a stream is whose
        placement this gateway never heard of (lost with its connection, say)."""
        interval_s = min(self.config.heartbeat_timeout_s, self.config.resume_after_s) / 4
        while True:
            await self._sleep_judging_on_time(interval_s)
            judging = (self.workers.is_alive, self.workers.started_at_s)
            if self.table.has_lost(*judging) and await self._may_judge_silence():
                self.table.fail_lost(*judging)
            for worker_id, points in self.table.stalled(self.config.resume_after_s).items():
                await self._resume(worker_id, points)
            unplaced = self.table.unplaced(UNPLACED_RESUME_FACTOR * self.config.resume_after_s)
            if unplaced:
                for worker in self.workers.alive("decode"):
                    await self._resume(worker.worker_id, unplaced, is_unplaced=True)

    async def _resume(self, worker_id: str, points: list[ResumePoint], *,
                      is_unplaced: bool = False) -> None:
        reply_subject = self.subjects.gateway(self.gateway_id)
        for start in range(0, len(points), RESUME_POINTS_PER_MESSAGE):
            with contextlib.suppress(nats.errors.Error):
                await self.nc.publish(self.subjects.stream_resume(worker_id), encode(
                    StreamResume(reply_subject=reply_subject, is_unplaced=is_unplaced,
                                 points=points[start:start + RESUME_POINTS_PER_MESSAGE])))

    def _worker_views(self) -> list[WorkerDirectory]:
        return [self.workers]

    async def _stop_intake(self) -> None:
        self._is_accepting = False

    async def _drain(self) -> None:
        await self.wait_until(lambda: len(self.table) == 0)

    async def _close(self) -> None:
        self.table.fail_all(RequestAborted("gateway is shutting down"))
        if self._runner is not None:
            await self._runner.cleanup()

    async def _on_event(self, event: GatewayEvent) -> None:
        self.table.dispatch(event)

    async def _on_status_query(self, query: StreamQuery | OpenStreamsQuery
                               ) -> StreamStatus | OpenStreams:
        if isinstance(query, OpenStreamsQuery):
            return self.table.open_streams(query)
        return self.table.status(query)

    async def _on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self._observe(heartbeat)

    def _observe(self, heartbeat: WorkerHeartbeat, *, from_registry: bool = False) -> None:
        """A worker's heartbeat: into the worker view, and its model into the catalog."""
        if from_registry:
            self.workers.observe_entry(heartbeat)
        else:
            self.workers.observe(heartbeat)
        self.models.observe(heartbeat.model)

    # GatewayBackend.
    def check_accepting(self) -> None:
        if not self._is_accepting:
            raise WorkerUnavailable("gateway is shutting down")

    def model_list(self) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": self._created, "owned_by": "halfmoon",
                 **({"max_model_len": served.limits.max_model_len}
                    if (served := self.models.loaded(name)) is not None else {})}
                for name in self.models.names()]

    async def served_model(self, name: str) -> ServedModel:
        return await self.models.get(name)

    def parse_completion(self, request: CompletionRequest, model: ServedModel
                         ) -> list[ParsedRequest]:
        output = self._checked(completion_output(request), request, model)
        tokenizer = model.tokenizer
        parsed = []
        for index, prompt in enumerate(completion_prompts(request)):
            if isinstance(prompt, str):
                token_ids = tokenizer.encode(
                    prompt, add_special_tokens=request.add_special_tokens is not False)
                text = prompt
            else:
                token_ids, text = prompt, None
            one = validate(request, token_ids, model.limits, output=output,
                           default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, echo_text=text,
                           choice_index=index * output.choices_per_prompt(request.n))
            if output.echo and (text is None or one.prompt_token_ids != token_ids):
                # token ids, now checked, or a truncated prompt: echoed as their text
                one = dataclasses.replace(one, echo=tokenizer.decode(one.prompt_token_ids))
            parsed.append(one)
        return parsed

    def parse_chat(self, request: ChatCompletionRequest, model: ServedModel
                   ) -> list[ParsedRequest]:
        text, use = self.render_chat(request, model)
        output = self._checked(chat_output(request, use), request, model)
        token_ids = model.tokenizer.encode(text,
                                           add_special_tokens=bool(request.add_special_tokens))
        return [validate(request, token_ids, model.limits, output=output,
                         default_max_tokens=None)]

    def _checked(self, output: Output, request: GenerationParams, model: ServedModel
                 ) -> Output:
        """`output` with its grammar checked against the compiler and the request's bad
        words tokenized with its model's tokenizer; a priority only where this gateway's
        scheduling policy serves one (vLLM's default refuses it alike)."""
        if request.priority and self.config.scheduling_policy != "priority":
            raise UnsupportedParameter("this gateway schedules first come, first served: "
                                       "priority must be 0 (or start it with "
                                       "--scheduling-policy priority)", param="priority")
        if output.grammar is not None:
            check_grammar(output.grammar, output.grammar_param)
        return dataclasses.replace(
            output, bad_words=bad_word_sequences(request.bad_words, model.tokenizer))

    def render_chat(self, request: ChatCompletionRequest, model: ServedModel
                    ) -> tuple[str, ToolUse | None]:
        """The prompt text of a chat request, and how its output may call its tools."""
        template, tokenizer = model.template, model.tokenizer
        tools, use = chat_tools(request, tool_format(template.source),
                                template_has_tools=template.supports_tools)
        text = template.render(chat_messages(request), bos_token=tokenizer.bos_token,
                               eos_token=tokenizer.eos_token, tools=tools,
                               add_generation_prompt=request.add_generation_prompt is not False,
                               continue_final_message=bool(request.continue_final_message),
                               variables=request.chat_template_kwargs)
        return text, use

    def health(self) -> dict[str, Any]:
        """Ready when workers of this gateway's own model can serve a request; `models` says
        the same of every model served (one model's workers lost leaves the others' up)."""
        models = {name: self._model_health(name) for name in self.models.names()}
        own = models[self.models.own_name]
        is_ok = self._is_accepting and own["is_ready"]
        return {"status": "ok" if is_ok else "unavailable", "gateway_id": self.gateway_id,
                "num_prefill_workers": own["num_prefill_workers"],
                "num_decode_workers": own["num_decode_workers"],
                "num_open_requests": len(self.table), "models": models}

    def _model_health(self, model: str) -> dict[str, Any]:
        num_prefill = len(self.workers.healthy("prefill", model=model))
        decodes = self.workers.healthy("decode", model=model)
        # Colocated decode workers prefill for themselves: no prefill worker is needed then.
        can_prefill = num_prefill > 0 or any(d.local_prefill_max_tokens > 0 for d in decodes)
        return {"num_prefill_workers": num_prefill, "num_decode_workers": len(decodes),
                "is_ready": can_prefill and bool(decodes)}

