"""The Responses API's routes: create (the chat request it means, after the conversation of
the response it continues), and retrieve, list the input items of, or delete a stored one.

A response is stored (response_store.py) once it is done, before its last event or its body
leaves, so that a client holding its id can continue it at once, through any gateway.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Protocol

import msgspec
from aiohttp import web

from services.gateway.generation import Generator
from services.gateway.json_bodies import encoder, event_stream, json_response, worked_on
from services.gateway.model_catalog import ServedModel
from services.gateway.openai_schema import ChatCompletionRequest, decode_body
from services.gateway.response_events import Event, ResponseState, settings_of
from services.gateway.response_store import ResponseStore
from services.gateway.responses_api import (
    InputItem,
    ResponsesRequest,
    chat_request,
    input_items,
    named_for_responses,
    wants_logprobs,
)
from services.gateway.validation import ParsedRequest
from shared.errors import HalfmoonError, InvalidRequest


class ResponsesBackend(Protocol):
    """What the Responses API's routes need from the gateway service."""

    generator: Generator
    responses: ResponseStore

    def check_accepting(self) -> None: ...

    async def served_model(self, name: str) -> ServedModel: ...

    def parse_chat(self, request: ChatCompletionRequest, model: ServedModel
                   ) -> list[ParsedRequest]: ...


class ResponsesRoutes:
    def __init__(self, backend: ResponsesBackend) -> None:
        self.backend = backend

    def add_to(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/responses", self.create)
        router.add_get("/v1/responses/{response_id}", self.retrieve)
        router.add_delete("/v1/responses/{response_id}", self.delete)
        router.add_get("/v1/responses/{response_id}/input_items", self.input_items)
        router.add_post("/v1/responses/{response_id}/cancel", self.cancel)

    async def create(self, request: web.Request) -> web.StreamResponse:
        self.backend.check_accepting()
        raw = await request.read()
        body = decode_body(raw, ResponsesRequest)
        model = await self.backend.served_model(body.model)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            history = (await self.backend.responses.previous(body.previous_response_id)
                       ).conversation
        try:
            chat = chat_request(body, msgspec.convert(history, list[InputItem]))
            parsed = (await worked_on(raw, lambda: self.backend.parse_chat(chat, model),
                                      is_large=bool(history)))[0]
        except InvalidRequest as exc:
            raise named_for_responses(exc) from None
        state = ResponseState(f"resp_{uuid.uuid4().hex}", model.name, settings_of(body),
                              model.token_text, parsed, wants_logprobs=wants_logprobs(body))
        seen = history + [{"type": item.type, **msgspec.to_builtins(item)}
                          for item in input_items(body)]
        return await self._respond(request, parsed, state, seen)

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        stored = await self.backend.responses.get(request.match_info["response_id"])
        return json_response(stored.response)

    async def delete(self, request: web.Request) -> web.StreamResponse:
        response_id = request.match_info["response_id"]
        await self.backend.responses.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, request: web.Request) -> web.StreamResponse:
        """Every item the model saw for this response (earlier turns' too), oldest first."""
        stored = await self.backend.responses.get(request.match_info["response_id"])
        items = stored.conversation[:stored.num_input_items]
        return json_response({"object": "list", "data": items, "has_more": False,
                              "first_id": None, "last_id": None})

    async def cancel(self, request: web.Request) -> web.StreamResponse:
        await self.backend.responses.get(request.match_info["response_id"])
        raise InvalidRequest("Only responses created with background: true can be cancelled; "
                             "halfmoon runs none")

    async def _respond(self, request: web.Request, parsed: ParsedRequest, state: ResponseState,
                       seen: list[dict[str, Any]]) -> web.StreamResponse:
        """The whole object, or its events as they happen (named SSE events, no `[DONE]`)."""
        generator = self.backend.generator
        async with contextlib.aclosing(generator.stream(state.response_id, parsed)) as chunks:
            if not parsed.is_stream:
                async for _, chunk in chunks:
                    state.add(chunk)
                await self._keep(state, seen)
                return json_response(state.body())
            first = await anext(chunks)  # as chat: a rejection still gets its HTTP status
            response = event_stream()
            await response.prepare(request)
            try:
                await _send(response, state.opening() + state.add(first[1]))
                async for _, chunk in chunks:
                    await _send(response, state.add(chunk))
            except HalfmoonError as exc:
                await _send(response, state.failed(exc))
                return response
            await self._keep(state, seen)
            await _send(response, [state.finished()])
            return response

    async def _keep(self, state: ResponseState, seen: list[dict[str, Any]]) -> None:
        """Store a finished response if its request asked (`store`, default true)."""
        if state.settings["store"]:
            state.settings["store"] = await self.backend.responses.keep(
                state.body(), seen + state.output(), num_input_items=len(seen))


async def _send(response: web.StreamResponse, events: list[Event]) -> None:
    for event in events:
        await response.write(b"event: " + event["type"].encode() + b"\ndata: "
                             + encoder.encode(event) + b"\n\n")
