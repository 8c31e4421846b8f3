"""The tokenizer's routes, as vLLM names and shapes them: `POST /tokenize` (a prompt, or chat
messages rendered exactly as a chat request renders them) and `POST /detokenize`. Clients
count tokens and check prompts against the context with them, with the served model's own
tokenizer and template."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec
from aiohttp import web

from services.gateway.json_bodies import json_response, worked_on
from services.gateway.model_catalog import ServedModel
from services.gateway.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    ToolDef,
    decode_body,
)
from services.gateway.tool_calls import ToolUse
from shared.errors import InvalidRequest

TOKENIZER_ROUTES = frozenset({"/tokenize", "/detokenize"})  # behind the API key, as /v1


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `prompt`, or chat `messages` (with the chat request's template options)."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    tokens: list[int]


class TokenizeBackend(Protocol):
    async def served_model(self, name: str) -> ServedModel: ...

    def render_chat(self, request: ChatCompletionRequest, model: ServedModel
                    ) -> tuple[str, ToolUse | None]: ...


class TokenizeRoutes:
    def __init__(self, backend: TokenizeBackend) -> None:
        self.backend = backend

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/tokenize", self.tokenize)
        router.add_post("/detokenize", self.detokenize)

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = decode_body(raw, TokenizeRequest)
        model = await self.backend.served_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("send a prompt or messages, one of them", param="prompt")
        return json_response(await worked_on(raw, lambda: self._tokenized(body, model)))

    def _tokenized(self, body: TokenizeRequest, model: ServedModel) -> dict[str, Any]:
        if body.messages is not None:
            text, _ = self.backend.render_chat(ChatCompletionRequest(
                model=body.model, messages=body.messages, tools=body.tools,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs), model)
            add_special_tokens = bool(body.add_special_tokens)
        else:
            text, add_special_tokens = body.prompt or "", body.add_special_tokens is not False
        tokens = model.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"count": len(tokens), "max_model_len": model.limits.max_model_len,
                "tokens": tokens, "token_strs": [model.token_text.text(t) for t in tokens]
                if body.return_token_strs else None}

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body = decode_body(await request.read(), DetokenizeRequest)
        model = await self.backend.served_model(body.model)
        vocab_size = model.limits.vocab_size
        if any(not 0 <= token < vocab_size for token in body.tokens):
            raise InvalidRequest(f"tokens must lie in [0, {vocab_size})", param="tokens")
        return json_response({"prompt": model.tokenizer.decode(body.tokens)})
