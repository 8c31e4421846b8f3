"""The gateway service: OpenAI HTTP in front, NATS behind.

Lifecycle: start() declares the request stream, subscribes to its own reply subject and to
worker heartbeats (for /health), then opens the HTTP port. stop() refuses new requests (503),
lets streams in flight finish up to `drain_timeout_s`, then closes the HTTP server; requests
still open at that point get an error event and their downstream work is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import socket
import uuid
from pathlib import Path
from typing import Any

import nats.errors
from aiohttp import web

from services.gateway.api import build_app
from services.gateway.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from services.gateway.generation import Generator, GeneratorContext
from services.gateway.model_info import read_model_info
from services.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    ParsedRequest,
    chat_messages,
    chat_output,
    chat_tools,
    completion_output,
    completion_prompts,
    validate,
)
from services.gateway.request_stream import StreamTable
from services.gateway.responses import TokenText
from services.gateway.structured import PARAM, check_grammar
from services.gateway.tokenizer import ByteTokenizer, HfTokenizer, Tokenizer
from services.gateway.tool_calls import tool_format
from shared.config import GatewayConfig
from shared.errors import ConfigError, RequestAborted, WorkerUnavailable
from shared.heartbeats import WorkerDirectory
from shared.messages import GatewayEvent, StreamResume, WorkerHeartbeat
from shared.metrics import GatewayMetrics
from shared.model_dir import resolve_model_dir
from shared.nats_client import encode, ensure_work_queue, read_registry
from shared.service import Service

# OpenAI's legacy completions endpoint defaults to 16 new tokens; chat fills the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


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
        self.model = config.model
        self.api_key = config.api_key
        self.limits = Limits(config.model, config.max_model_len, 0)
        self.table = StreamTable()
        self.workers = WorkerDirectory(timeout_s=config.heartbeat_timeout_s)
        self.port: int | None = None
        self._template: ChatTemplate | None = None
        self._generator: Generator | None = None
        self._runner: web.AppRunner | None = None
        self._is_accepting = False

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
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise WorkerUnavailable("gateway is not started")
        return self._tokenizer

    @functools.cached_property
    def token_text(self) -> TokenText:
        return TokenText(self.tokenizer)

    async def _setup(self) -> None:
        template_source = await asyncio.to_thread(self._load_tokenizer)
        self._template = ChatTemplate(self._read_template() or template_source)
        js = self.nc.jetstream()
        await ensure_work_queue(js, self.subjects.requests_stream, self.subjects.requests,
                                max_age_s=self.config.request_timeout_s,
                                replicas=self.config.js_replicas)
        reply_subject = self.subjects.gateway(self.gateway_id)
        await self.serve(reply_subject, GatewayEvent, self._on_event)
        await self.serve(self.subjects.all_heartbeats, WorkerHeartbeat, self._on_heartbeat)
        for heartbeat in await read_registry(self.nc.jetstream(), self.subjects.workers_bucket):
            self.workers.observe_entry(heartbeat)
        self._generator = Generator(GeneratorContext(
            nc=self.nc, js=js, subjects=self.subjects, reply_subject=reply_subject,
            table=self.table, tokenizer=self.tokenizer, timeout_s=self.config.request_timeout_s,
            metrics=self.metrics, events=self.events,
        ))
        await self._serve_http()
        self.spawn(self._watch_workers(), "watch-workers")
        self._is_accepting = True

    def _load_tokenizer(self) -> str:
        """Load the tokenizer and the model's limits; return the model's chat template."""
        config = self.config
        if self._tokenizer is None and config.tokenizer == "bytes":
            self._tokenizer = ByteTokenizer()
        if self._tokenizer is not None:
            self.limits = Limits(config.model, config.max_model_len, self.tokenizer.vocab_size)
            return DEFAULT_CHAT_TEMPLATE
        model_dir = resolve_model_dir(config.model_path)
        if not (model_dir / "config.json").exists():
            raise ConfigError(f"no model at {model_dir}: pass --model-path, or run "
                              "`halfmoon model init` for the built-in one")
        hf = HfTokenizer(model_dir)
        info = read_model_info(model_dir)
        self._tokenizer = hf
        self.limits = Limits(config.model, min(config.max_model_len,
                                               info.max_position_embeddings), info.vocab_size)
        return hf.chat_template or DEFAULT_CHAT_TEMPLATE

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
        """Fail over requests whose worker stopped heartbeating (their readers place them
        again as continuations); ask decode workers to resend what stalled streams may have
        lost."""
        interval_s = min(self.config.heartbeat_timeout_s, self.config.resume_after_s) / 4
        while True:
            await self._sleep_judging_on_time(interval_s)
            self.table.fail_lost(self.workers.is_alive)
            for worker_id, points in self.table.stalled(self.config.resume_after_s).items():
                with contextlib.suppress(nats.errors.Error):
                    await self.nc.publish(self.subjects.stream_resume(worker_id), encode(
                        StreamResume(reply_subject=self.subjects.gateway(self.gateway_id),
                                     points=points)))

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

    async def _on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self.workers.observe(heartbeat)

    # GatewayBackend.
    def check_accepting(self) -> None:
        if not self._is_accepting:
            raise WorkerUnavailable("gateway is shutting down")

    def parse_completion(self, request: CompletionRequest) -> list[ParsedRequest]:
        output = completion_output(request)
        if output.grammar is not None:
            check_grammar(output.grammar)
        parsed = []
        for index, prompt in enumerate(completion_prompts(request)):
            if isinstance(prompt, str):
                token_ids, text = self.tokenizer.encode(prompt, add_special_tokens=True), prompt
            else:
                token_ids, text = prompt, None
            one = validate(request, token_ids, self.limits, output=output,
                           default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS, echo_text=text,
                           choice_index=index * (request.n or 1))
            if output.echo and text is None:  # token ids, now checked: echoed as their text
                one = dataclasses.replace(one, echo=self.tokenizer.decode(token_ids))
            parsed.append(one)
        return parsed

    def parse_chat(self, request: ChatCompletionRequest) -> list[ParsedRequest]:
        if self._template is None:
            raise WorkerUnavailable("gateway is not started")
        tools, use = chat_tools(request, tool_format(self._template.source),
                                template_has_tools=self._template.supports_tools)
        output = chat_output(request, use)
        if output.grammar is not None:
            check_grammar(output.grammar, "tools" if use and use.is_forced else PARAM)
        text = self._template.render(chat_messages(request), bos_token=self.tokenizer.bos_token,
                                     eos_token=self.tokenizer.eos_token, tools=tools)
        return [validate(request, self.tokenizer.encode(text), self.limits,
                         output=output, default_max_tokens=None)]

    def health(self) -> dict[str, Any]:
        """Ready when workers of this gateway's model can serve a request."""
        model = self.config.model
        num_prefill = len(self.workers.healthy("prefill", model=model))
        decodes = self.workers.healthy("decode", model=model)
        num_decode = len(decodes)
        # Colocated decode workers prefill for themselves: no prefill worker is needed then.
        can_prefill = num_prefill > 0 or any(d.local_prefill_max_tokens > 0 for d in decodes)
        is_ok = self._is_accepting and can_prefill and num_decode > 0
        return {"status": "ok" if is_ok else "unavailable", "gateway_id": self.gateway_id,
                "num_prefill_workers": num_prefill, "num_decode_workers": num_decode,
                "num_open_requests": len(self.table)}

