"""The Responses API's request (`POST /v1/responses`): translated into the chat request it
means, which the chat path then validates, renders and serves.

Input items are messages (text parts only), function calls and their outputs; a request
with `previous_response_id` continues that stored response's conversation (response_store.py).
Tools are function tools. What would change the output and is not served (other tool types,
reasoning settings, images, `conversation` objects, `background`) is refused with a 400
naming it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.openai_schema import (
    MAX_LOGPROBS,
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    FunctionName,
    JsonSchemaFormat,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolDef,
)
from shared.errors import InvalidRequest, UnsupportedParameter

MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant"})
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# `include` entries with nothing to add here: halfmoon emits no reasoning items.
NOTHING_TO_INCLUDE = frozenset({"reasoning.encrypted_content"})
# The chat path's checks name chat's fields: an error names the field this request sent.
_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "messages": "input", "response_format": "text.format",
           "logprobs": "include", "prompt": "input"}


class InputPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A content part of an input message; replayed output parts carry more (annotations,
    logprobs), which are not input and are ignored."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One item of `input`: a message (`type` may be left out), a `function_call` replayed
    from an earlier response, or a `function_call_output`. Replayed items keep their `id`
    and `status`; they do not change what is rendered."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class TextSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextSettings | None = None
    reasoning: Reasoning | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    # Refused: conversation objects, background runs and stored prompt templates are not
    # served.
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    # No effect: it bounds calls to built-in tools, and none runs here (function tools are
    # the client's to call).
    max_tool_calls: int | None = None
    priority: int | None = None  # vLLM's, as on chat: lower first (`--scheduling-policy`)
    # Metadata only: accepted, no effect on generation.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


def input_items(request: ResponsesRequest) -> list[InputItem]:
    """`input` as items (a string is one user message)."""
    if isinstance(request.input, str):
        return [InputItem(role="user", content=request.input)]
    if not request.input:
        raise InvalidRequest("input must not be empty", param="input")
    return request.input


def chat_request(request: ResponsesRequest, history: list[InputItem] | None = None
                 ) -> ChatCompletionRequest:
    """The chat request that `request` means, after the `history` of the response it
    continues; refuses what it cannot mean here."""
    _check_served(request)
    messages = [ChatMessage(role="system", content=request.instructions)
                ] if request.instructions else []
    messages += input_messages(history or []) + input_messages(input_items(request))
    fmt = request.text.format if request.text is not None else None
    return ChatCompletionRequest(
        model=request.model, messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature, top_p=request.top_p,
        stream=request.stream, stream_options=None,
        logprobs=wants_logprobs(request) or None, top_logprobs=request.top_logprobs,
        tools=[_tool(tool, i) for i, tool in enumerate(request.tools)] if request.tools else None,
        tool_choice=_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls,
        response_format=None if fmt is None else _response_format(fmt),
        user=request.user, metadata=request.metadata, store=request.store,
        service_tier=request.service_tier, prompt_cache_key=request.prompt_cache_key,
        safety_identifier=request.safety_identifier, priority=request.priority,
    )


def named_for_responses(error: InvalidRequest) -> InvalidRequest:
    """`error` from the chat path's checks, its field named as this API names it."""
    if error.param in ("max_tokens", "max_completion_tokens"):  # named in the message too
        error.message = error.message.replace(error.param, "max_output_tokens")
    if error.param in _PARAMS:
        error.param = _PARAMS[error.param]
    return error


def wants_logprobs(request: ResponsesRequest) -> bool:
    """Logprobs come with the output text when `include` asks, or `top_logprobs` is set."""
    return LOGPROBS_INCLUDE in (request.include or ()) or request.top_logprobs is not None


def _check_served(request: ResponsesRequest) -> None:
    unserved = ("conversation" if request.conversation is not None
                else "background" if request.background else None)
    if unserved is not None:
        raise UnsupportedParameter(
            f"halfmoon does not support `{unserved}`: continue a response with "
            "`previous_response_id`, or send the whole conversation in `input`",
            param=unserved)
    if request.prompt is not None:
        raise UnsupportedParameter("halfmoon does not support `prompt` (stored prompt "
                                   "templates): send the instructions and input themselves",
                                   param="prompt")
    if request.max_tool_calls is not None and request.max_tool_calls < 0:
        raise InvalidRequest("max_tool_calls must be >= 0", param="max_tool_calls")
    for entry in request.include or ():
        if entry != LOGPROBS_INCLUDE and entry not in NOTHING_TO_INCLUDE:
            raise UnsupportedParameter(f"include {entry!r} is not supported", param="include")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must lie in [0, {MAX_LOGPROBS}]",
                             param="top_logprobs")
    if request.truncation not in (None, "disabled"):
        raise UnsupportedParameter("only truncation 'disabled' is supported: an input too "
                                   "long for the model is refused", param="truncation")
    reasoning = request.reasoning
    if reasoning is not None and (reasoning.effort or reasoning.summary
                                  or reasoning.generate_summary):
        raise UnsupportedParameter("halfmoon does not support `reasoning`", param="reasoning")
    if request.text is not None and request.text.verbosity not in (None, "medium"):
        raise UnsupportedParameter("halfmoon does not support `text.verbosity`",
                                   param="text.verbosity")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true",
                             param="stream_options")


def input_messages(items: list[InputItem]) -> list[ChatMessage]:
    """Items as chat turns: function calls in a row become one assistant turn's calls."""
    messages: list[ChatMessage] = []
    calls: list[MessageToolCall] = []
    for i, item in enumerate(items):
        if item.type == "function_call":
            calls.append(_call(item, i))
            continue
        if calls:
            messages.append(ChatMessage(role="assistant", tool_calls=calls))
            calls = []
        if item.type == "message":
            messages.append(_message(item, i))
        elif item.type == "function_call_output":
            if not item.call_id or item.output is None:
                raise InvalidRequest(f"input[{i}]: a function_call_output needs call_id and "
                                     "output", param="input")
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, i)))
        else:
            raise UnsupportedParameter(f"input[{i}]: item type {item.type!r} is not supported "
                                       "(messages, function_call, function_call_output)",
                                       param="input")
    if calls:
        messages.append(ChatMessage(role="assistant", tool_calls=calls))
    return messages


def _message(item: InputItem, i: int) -> ChatMessage:
    if item.role not in MESSAGE_ROLES:
        raise InvalidRequest(f"input[{i}].role {item.role!r} is not one of "
                             f"{sorted(MESSAGE_ROLES)}", param="input")
    if item.content is None:
        raise InvalidRequest(f"input[{i}].content is missing", param="input")
    return ChatMessage(role=item.role, content=_text(item.content, i))


def _text(content: str | list[InputPart], i: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type == "refusal":
            continue  # an earlier answer's refusal, replayed: as chat, not rendered
        if part.type not in TEXT_PARTS:
            raise InvalidRequest(f"input[{i}].content: only text parts are supported, got "
                                 f"{part.type!r}", param="input")
        if part.text is None:
            raise InvalidRequest(f"input[{i}].content: a text part needs its text",
                                 param="input")
        texts.append(part.text)
    return "".join(texts)


def _call(item: InputItem, i: int) -> MessageToolCall:
    if not item.call_id or not item.name or item.arguments is None:
        raise InvalidRequest(f"input[{i}]: a function_call needs call_id, name and arguments",
                             param="input")
    return MessageToolCall(id=item.call_id,
                           function=CalledFunction(name=item.name, arguments=item.arguments))


def _tool(tool: ResponsesTool, i: int) -> ToolDef:
    if tool.type != "function":
        raise UnsupportedParameter(f"tools[{i}]: tool type {tool.type!r} is not supported "
                                   "(function tools only)", param="tools")
    if not tool.name:
        raise InvalidRequest(f"tools[{i}] needs a name", param="tools")
    return ToolDef(type="function", function=FunctionDef(
        name=tool.name, description=tool.description, parameters=tool.parameters,
        strict=tool.strict))


def _tool_choice(choice: str | ResponsesToolChoice | None) -> str | NamedToolChoice | None:
    if not isinstance(choice, ResponsesToolChoice):
        return choice  # "none", "auto", "required" (the chat path checks the word)
    if choice.type != "function":
        raise UnsupportedParameter(f"tool_choice of type {choice.type!r} is not supported "
                                   "(a function, by name)", param="tool_choice")
    if not choice.name:
        raise InvalidRequest("tool_choice of type 'function' needs the function's name",
                             param="tool_choice")
    return NamedToolChoice(type="function", function=FunctionName(name=choice.name))


def _response_format(fmt: TextFormat) -> ResponseFormat:
    if fmt.type not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(f"text.format.type {fmt.type!r} is not one of 'text', "
                             "'json_object', 'json_schema'", param="text.format")
    if fmt.type != "json_schema":
        return ResponseFormat(type=fmt.type)
    if fmt.schema_ is None:
        raise InvalidRequest("text.format json_schema needs a schema", param="text.format")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", schema_=fmt.schema_, description=fmt.description,
        strict=fmt.strict))
