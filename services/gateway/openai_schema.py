"""OpenAI request schemas, decoded strictly; the prompts and chat messages they carry.
(`validation` checks them against the served model.)

Strict: a field that is not declared here is refused (`UnsupportedParameter`, 400), as OpenAI
refuses an unrecognized argument; nothing that would change the output is ever dropped. The
metadata-only fields OpenAI defines (`user`, `metadata`, `store`, ...) are accepted and do not
change generation. The README's parameter table lists every accepted field.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec

from services.gateway.guided import GuidedParams
from services.gateway.tool_calls import (
    ToolFormat,
    ToolUse,
    check_function_name,
    forced_call_grammar,
)
from shared.errors import InvalidRequest, UnsupportedParameter
from shared.messages import GrammarSpec

# OpenAI takes 4; vLLM and SGLang any number, and evaluation harnesses send more (lm-eval's
# HumanEval and MBPP tasks: 5). Each is matched against every token's text, so some bound.
MAX_STOP_STRINGS = 64
MAX_PROMPTS = 256  # prompts in one completions request
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 128  # n: OpenAI's bound (vLLM has none; pass@k evaluations ask 100 and more)
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Fields of OpenAI's API that would change the output and that halfmoon does not serve:
# named in the refusal, like unknown fields.
NOT_SERVED = frozenset({
    "tools", "tool_choice", "functions", "function_call", "audio",
    "prediction", "reasoning_effort", "web_search_options", "verbosity", "suffix",
})


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: `usage` so far on every chunk
    include_obfuscation: bool | None = None  # accepted; chunks carry no padding


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None  # outputs always keep to the schema


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class GenerationParams(GuidedParams, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Engine extensions (vLLM's names and meanings).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # only these tokens may be drawn
    bad_words: list[str] | None = None  # words the output must not write
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None  # the prompt's and the output's ids beside the text
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens `token_id:N`
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: fit)
    prompt_logprobs: int | None = None  # each prompt token's logprob, rank and top k
    # The tokenizer's own special tokens (a BOS) around the prompt text: by default yes for a
    # prompt, no for chat (its template writes them).
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None  # on completions too, as vLLM
    # vLLM's, accepted for its clients: beam search is not served (`use_beam_search` true is
    # refused; `length_penalty` weighs beams only), special tokens are written as the fast
    # tokenizer writes them (as vLLM's fast detokenizer ignores the spacing flag).
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    spaces_between_special_tokens: bool | None = None
    # Lower is served first where requests wait; other than 0 only under the gateway's
    # `--scheduling-policy priority` (refused otherwise, as vLLM's default scheduler does).
    priority: int | None = None
    # vLLM's structured-output extensions come from GuidedParams (guided.py).
    # Metadata only: accepted, no effect on generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(GenerationParams, kw_only=True, forbid_unknown_fields=True):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[Any]
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class CalledFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text


class MessageToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    type: str = "function"
    function: CalledFunction


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None  # an assistant turn's refusal, replayed: not rendered
    tool_calls: list[MessageToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    # An assistant reply sent back whole (`message.model_dump()`): its citations are not
    # rendered; audio and a deprecated function call are refused unless null.
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class FunctionDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always keep to the parameters


class ToolDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class FunctionName(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: FunctionName


class ChatCompletionRequest(GenerationParams, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # only ["text"]
    # Chat template extensions (vLLM's names and meanings).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


T = TypeVar("T")

_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def decode_body(body: bytes, schema: type[T]) -> T:
    """Decode JSON into `schema`; any problem becomes `InvalidRequest` naming the field, and
    a field halfmoon does not serve becomes `UnsupportedParameter`."""
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        path = match.group(1) if (match := _PATH.search(str(exc))) else ""
        if (unknown := _UNKNOWN.search(str(exc))) is not None:
            field = unknown.group(1)
            param = f"{path}.{field}" if path else field
            if field in NOT_SERVED and not path:
                if (unset := _without_unset_fields(body)) is not None:
                    return decode_body(unset, schema)
                raise UnsupportedParameter(f"halfmoon does not support `{field}`",
                                           param=param) from exc
            raise UnsupportedParameter(f"Unrecognized request argument supplied: {param}",
                                       param=param) from exc
        raise InvalidRequest(str(exc), param=path.split("[")[0].split(".")[0] or None) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from exc


def _without_unset_fields(body: bytes) -> bytes | None:
    """The body without the fields halfmoon does not serve that it sends as null (unset:
    the API's own default, as some clients send every field they know), or None when it
    sends none so; one sent with a value is still refused."""
    fields = msgspec.json.decode(body)
    unset = [name for name in NOT_SERVED
             if isinstance(fields, dict) and name in fields and fields[name] is None]
    if not unset:
        return None
    return msgspec.json.encode({k: v for k, v in fields.items() if k not in unset})


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """Every prompt of the request: each a text or a list of token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if all(_is_token_id(p) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        prompts: list[str | list[int]] = list(prompt)
    elif all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token "
                             "ids, or a list of non-empty token-id lists", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"at most {MAX_PROMPTS} prompts in one request", param="prompt")
    return prompts


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template, with text parts joined."""
    if not request.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    if request.modalities not in (None, ["text"]):
        raise UnsupportedParameter("only the text modality is served", param="modalities")
    if request.continue_final_message and request.add_generation_prompt:
        raise InvalidRequest("continue_final_message and add_generation_prompt cannot both "
                             "be true", param="continue_final_message")
    rendered = []
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {message.role!r} is not one of {sorted(CHAT_ROLES)}",
                param="messages",
            )
        for field in ("audio", "function_call"):
            if getattr(message, field) is not None:
                raise UnsupportedParameter(f"halfmoon does not support `{field}` in messages",
                                           param=f"messages[{i}].{field}")
        if message.content is None and message.role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is missing: a {message.role} turn "
                                 "needs a string or text parts", param="messages")
        turn: dict[str, Any] = {"role": message.role, "content": _message_text(message, i)}
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidRequest(f"messages[{i}]: only assistant turns carry tool_calls",
                                     param="messages")
            turn["tool_calls"] = [_rendered_call(call) for call in message.tool_calls]
        if message.role == "tool":
            if not message.tool_call_id:
                raise InvalidRequest(f"messages[{i}]: a tool turn needs tool_call_id",
                                     param="messages")
            turn["tool_call_id"] = message.tool_call_id
        rendered.append(turn)
    return rendered


def _rendered_call(call: MessageToolCall) -> dict[str, Any]:
    """A call as chat templates take it: `arguments` as an object when they are JSON text,
    else the text as it is (a call cut short by `max_tokens`, replayed: OpenAI takes any
    string; the common templates print a string as it is, and one that cannot is a 400)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": arguments}}


def chat_tools(request: ChatCompletionRequest, fmt: ToolFormat, *, template_has_tools: bool
               ) -> tuple[list[dict[str, Any]] | None, ToolUse | None]:
    """The tools for the chat template, and how the output may call them."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None, None
    if not template_has_tools:
        raise UnsupportedParameter("this model's chat template does not render tools",
                                   param="tools")
    functions: dict[str, dict[str, Any]] = {}
    for tool in request.tools:
        if tool.type != "function":
            raise InvalidRequest(f"tool type {tool.type!r} is not 'function'", param="tools")
        check_function_name(tool.function.name, "tools")
        if tool.function.name in functions:
            raise InvalidRequest(f"tool {tool.function.name!r} is defined twice", param="tools")
        functions[tool.function.name] = tool.function.parameters or {
            "type": "object", "properties": {}}
    rendered = [{"type": "function", "function": {
        key: value for key, value in msgspec.to_builtins(tool.function).items()
        if value is not None}} for tool in request.tools]
    if choice == "none":
        return rendered, None
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function" or choice.function.name not in functions:
            raise InvalidRequest(f"tool_choice names {choice.function.name!r}, which is not "
                                 "among the tools", param="tool_choice")
        forced = {choice.function.name: functions[choice.function.name]}
    elif choice in (None, "auto", "required"):
        forced = functions if choice == "required" else {}
    else:
        raise InvalidRequest(f"tool_choice {choice!r} is not 'none', 'auto', 'required' or "
                             "a named function", param="tool_choice")
    use = ToolUse(fmt, frozenset(functions), is_forced=bool(forced),
                  is_parallel=request.parallel_tool_calls is not False)
    return rendered, use


def forced_tool_grammar(request: ChatCompletionRequest, use: ToolUse | None
                        ) -> GrammarSpec | None:
    """The grammar of a forced call (`required`, or the named function)."""
    if use is None or not use.is_forced or not request.tools:
        return None
    choice = request.tool_choice
    names = ({choice.function.name} if isinstance(choice, NamedToolChoice)
             else set(use.names))
    tools = {t.function.name: t.function.parameters or {"type": "object", "properties": {}}
             for t in request.tools if t.function.name in names}
    return forced_call_grammar(tools, use.format)


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text":
            raise InvalidRequest(
                f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                param="messages",
            )
        if part.text is None:
            raise InvalidRequest(f"messages[{i}].content: a text part needs its text",
                                 param="messages")
        texts.append(part.text)
    return "".join(texts)
