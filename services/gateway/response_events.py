"""The Responses API's response object and stream events.

`ResponseState` follows one response as its chunks arrive and says, for each, the events a
stream sends (`response.output_text.delta`, ...); the whole response object is built from the
same state. Its output items are a message (text streams as it comes; with tools, text that
may be a call is held back, as in chat) and the function calls, each item opened when it
begins (a call's arguments stream as they are written, `CallArguments`; calls in other
shapes come whole at the end). A response cut short by `max_output_tokens` is `incomplete`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from services.gateway.call_arguments import CallStream
from services.gateway.responses import TokenText
from services.gateway.responses_api import ResponsesRequest
from services.gateway.text_chunks import TextChunk
from services.gateway.validation import ParsedRequest
from shared.errors import HalfmoonError
from shared.messages import FinishReason

Event = dict[str, Any]


def settings_of(request: ResponsesRequest) -> dict[str, Any]:
    """The request's settings, as every response object repeats them."""
    text_format: dict[str, Any] = {"type": "text"}
    if request.text is not None and request.text.format is not None:
        fmt = request.text.format
        text_format = {key: value for key, value in {
            "type": fmt.type, "name": fmt.name, "schema": fmt.schema_,
            "description": fmt.description, "strict": fmt.strict}.items() if value is not None}
    tool_choice = request.tool_choice or "auto"
    return {
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_logprobs": request.top_logprobs or 0,
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict is not False}
                  for t in request.tools or ()],
        "tool_choice": tool_choice if isinstance(tool_choice, str) else {
            "type": tool_choice.type, "name": tool_choice.name},
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "text": {"format": text_format, "verbosity": "medium"},
        "metadata": request.metadata or {}, "user": request.user,
        "service_tier": request.service_tier or "default",
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        "store": request.store is not False,  # until it turns out it could not be
        "background": False, "previous_response_id": request.previous_response_id,
        "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None}, "max_tool_calls": None,
    }


class ResponseState:
    """One response, from its first chunk to its end: the events of each step for a
    stream (`opening`, `add` per chunk, then `finished` once `is_done`), `body()` for the
    whole object."""

    def __init__(self, response_id: str, model: str, settings: dict[str, Any],
                 tokens: TokenText, parsed: ParsedRequest, *, wants_logprobs: bool) -> None:
        self.response_id, self.model, self.settings = response_id, model, settings
        self.created_at = int(time.time())
        self.tokens, self.wants_logprobs = tokens, wants_logprobs
        self.num_prompt_tokens = len(parsed.prompt_token_ids)
        self.call_stream = CallStream(parsed.tools) if parsed.tools is not None else None
        self.status = "in_progress"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.message_index: int | None = None  # its place among the output items, once begun
        self._calls: dict[int, dict[str, Any]] = {}  # function_call items by output index
        self._call_index: dict[int, int] = {}  # a call's delta index -> its output index
        self.text = ""
        self.logprobs: list[dict[str, Any]] = []
        self._unsent_logprobs: list[dict[str, Any]] = []  # of text held back (tools)
        self.finish_reason: FinishReason | None = None
        self.num_completion_tokens = self.num_cached_tokens = 0
        self.error: dict[str, Any] | None = None
        self._sequence = itertools.count()

    def opening(self) -> list[Event]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def add(self, chunk: TextChunk) -> list[Event]:
        """Take one chunk; the events it makes."""
        self.num_completion_tokens = chunk.num_completion_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if self.wants_logprobs and chunk.logprobs is not None:
            self._unsent_logprobs += self.tokens.entries(chunk.token_ids, chunk.logprobs)
        text, calls = chunk.text, []
        if self.call_stream is not None:  # text that may be a call is held back
            text, calls = self.call_stream.push(text)
            if chunk.finish_reason is not None:
                rest, unsent = self.call_stream.finish(is_cut=chunk.finish_reason == "length")
                text, calls = text + rest, calls + unsent
        events = self._text(text) if text else []
        for entry in calls:
            events += self._call(entry)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            events += self._closing()
        return events

    @property
    def is_done(self) -> bool:
        return self.status != "in_progress"

    def finished(self) -> Event:
        """The last event: `response.completed`, or `response.incomplete` when cut short."""
        name = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return self._lifecycle(name)

    def failed(self, error: HalfmoonError) -> list[Event]:
        """The response ended by an error after it began."""
        self.status = "failed"
        self.error = {"code": error.openai_code or error.code.value, "message": error.message}
        return [self._lifecycle("response.failed")]

    def body(self) -> dict[str, Any]:
        """The response object as it stands."""
        is_done = self.is_done
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": self.status, "error": self.error,
            "incomplete_details": ({"reason": "max_output_tokens"}
                                   if self.status == "incomplete" else None),
            "model": self.model, "output": self.output() if is_done else [],
            "usage": self._usage() if is_done else None, **self.settings,
        }

    # --- events ----------------------------------------------------------------------------

    def _text(self, text: str) -> list[Event]:
        events = [] if self.message_index is not None else self._message_opening()
        logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        self.text += text
        self.logprobs += logprobs
        events.append(self._event("response.output_text.delta", item_id=self.message_id,
                                  output_index=self.message_index, content_index=0,
                                  delta=text, logprobs=logprobs))
        return events

    def _message_opening(self) -> list[Event]:
        self.message_index = self._next_index
        item = {**self._message_item(), "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=self.message_index,
                            item=item),
                self._event("response.content_part.added", item_id=self.message_id,
                            output_index=self.message_index, content_index=0, part=part)]

    def _call(self, entry: dict[str, Any]) -> list[Event]:
        """A function call's item opened (`entry` has its id), or its arguments grown."""
        events = []
        if "id" in entry:
            index = self._call_index[entry["index"]] = self._next_index
            self._calls[index] = {
                "type": "function_call", "id": f"fc_{entry['id'].removeprefix('call_')}",
                "call_id": entry["id"], "name": entry["function"]["name"], "arguments": "",
                "status": "in_progress"}
            events.append(self._event("response.output_item.added", output_index=index,
                                      item=dict(self._calls[index])))
        index = self._call_index[entry["index"]]
        if piece := entry["function"]["arguments"]:
            self._calls[index]["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=self._calls[index]["id"], output_index=index,
                                      delta=piece))
        return events

    @property
    def _next_index(self) -> int:
        return len(self._calls) + (self.message_index is not None)

    def _closing(self) -> list[Event]:
        events = [] if self.message_index is not None or self._calls else (
            self._message_opening())
        self.status = "incomplete" if self.finish_reason == "length" else "completed"
        if (at := self.message_index) is not None:
            self.logprobs += self._unsent_logprobs
            item = self._message_item()
            events += [
                self._event("response.output_text.done", item_id=self.message_id,
                            output_index=at, content_index=0, text=self.text,
                            logprobs=self.logprobs),
                self._event("response.content_part.done", item_id=self.message_id,
                            output_index=at, content_index=0, part=item["content"][0]),
                self._event("response.output_item.done", output_index=at, item=item)]
        for index, item in self._calls.items():
            item["status"] = self.status  # a call cut short is incomplete, as the message
            events += [
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]
        return events

    def _lifecycle(self, kind: str) -> Event:
        return self._event(kind, response=self.body())

    def _event(self, kind: str, /, **fields: Any) -> Event:
        return {"type": kind, "sequence_number": next(self._sequence), **fields}

    # --- the response object ---------------------------------------------------------------

    def output(self) -> list[dict[str, Any]]:
        """The output items (a message, function calls), as a later turn's input takes them."""
        items = dict(self._calls)
        if self.message_index is not None:
            items[self.message_index] = self._message_item()
        return [items[index] for index in sorted(items)]

    def _message_item(self) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id,
                "status": "incomplete" if self.status == "incomplete" else "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": self.text, "annotations": [],
                             "logprobs": self.logprobs}]}

    def _usage(self) -> dict[str, Any]:
        return {"input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                "output_tokens": self.num_completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + self.num_completion_tokens}
