"""OpenAI request schemas and their validation into one internal form per prompt.

Strict: a field that is not declared here is refused (`UnsupportedParameter`, 400), as OpenAI
refuses an unrecognized argument; nothing that would change the output is ever dropped. The
metadata-only fields OpenAI defines (`user`, `metadata`, `store`, ...) are accepted and do not
change generation. The README's parameter table lists every accepted field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from services.gateway.guided import GuidedParams, guided_grammar
from services.gateway.tool_calls import (
    ToolFormat,
    ToolUse,
    check_function_name,
    forced_call_grammar,
)
from shared.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, UnsupportedParameter
from shared.messages import GrammarSpec, SamplingParams

MAX_STOP_STRINGS = 4
MAX_PROMPTS = 256  # prompts in one completions request
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
MAX_CHOICES = 16  # n
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


class _GenerationParams(GuidedParams, kw_only=True, forbid_unknown_fields=True):
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
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None  # the prompt's and the output's ids beside the text
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens `token_id:N`
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: fit)
    prompt_logprobs: int | None = None  # each prompt token's logprob, rank and top k
    response_format: ResponseFormat | None = None  # on completions too, as vLLM
    # vLLM's structured-output extensions come from GuidedParams (guided.py).
    # Metadata only: accepted, no effect on generation.
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_GenerationParams, kw_only=True, forbid_unknown_fields=True):
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


class ChatCompletionRequest(_GenerationParams, kw_only=True, forbid_unknown_fields=True):
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


@dataclass(frozen=True)
class Limits:
    model: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class ParsedRequest:
    """One prompt of a validated request, ready to publish; `choice_index` is its place
    among the response's choices."""

    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    is_stream: bool
    include_usage: bool
    choice_index: int = 0
    usage_on_every_chunk: bool = False
    echo: str | None = None  # the prompt text to put before the output, when `echo`
    is_prompt_only: bool = False  # `max_tokens: 0` with `echo`: the prompt, no output
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the matched stop string ends the text
    tools: ToolUse | None = None  # calls to find in the output (chat with tools)
    # `best_of`: of the `sampling.n` candidates, the number to return: those of highest
    # cumulative logprob. None: every choice is returned.
    num_returned: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: alternatives per prompt token, when asked


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
                raise UnsupportedParameter(f"halfmoon does not support `{field}`",
                                           param=param) from exc
            raise UnsupportedParameter(f"Unrecognized request argument supplied: {param}",
                                       param=param) from exc
        raise InvalidRequest(str(exc), param=path.split("[")[0].split(".")[0] or None) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from exc


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
        if message.content is None and message.role != "assistant":
            raise InvalidRequest(f"messages[{i}].content is missing: a {message.role} turn "
                                 "needs a string or text parts", param="messages")
        turn: dict[str, Any] = {"role": message.role, "content": _message_text(message, i)}
        if message.tool_calls:
            if message.role != "assistant":
                raise InvalidRequest(f"messages[{i}]: only assistant turns carry tool_calls",
                                     param="messages")
            turn["tool_calls"] = [_rendered_call(call, i) for call in message.tool_calls]
        if message.role == "tool":
            if not message.tool_call_id:
                raise InvalidRequest(f"messages[{i}]: a tool turn needs tool_call_id",
                                     param="messages")
            turn["tool_call_id"] = message.tool_call_id
        rendered.append(turn)
    return rendered


def _rendered_call(call: MessageToolCall, i: int) -> dict[str, Any]:
    """A call as chat templates take it: `arguments` as an object, not JSON text."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError as exc:
        raise InvalidRequest(f"messages[{i}].tool_calls: arguments of {call.function.name!r} "
                             "are not JSON", param="messages") from exc
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


@dataclass(frozen=True)
class Output:
    """What the client asked to get back, beyond the text."""

    logprobs: int | None = None  # alternatives per token; None: no logprobs
    echo: bool = False
    grammar: GrammarSpec | None = None  # what the output must match
    grammar_param: str = "response_format"  # the field that asked for it
    tools: ToolUse | None = None
    num_candidates: int | None = None  # `best_of`, when it asks for more than n

    def choices_per_prompt(self, n: int | None) -> int:
        """Choices generated per prompt: `best_of`'s candidates, else n."""
        return self.num_candidates or n or 1


def output_constraint(request: _GenerationParams) -> tuple[GrammarSpec | None, str]:
    """The grammar the output must keep to (`response_format` or vLLM's extensions, one of
    them) and the field that asked for it."""
    fmt = response_grammar(request.response_format)
    guided = guided_grammar(request)
    if guided is None:
        return fmt, "response_format"
    if fmt is not None:
        raise InvalidRequest(f"one output constraint per request, got response_format and "
                             f"{guided[1]}", param=guided[1])
    return guided


def response_grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar `response_format` asks for (None for free text). The schema itself is
    checked by `services.gateway.structured`."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec(kind="json_object")
    if response_format.type != "json_schema":
        raise InvalidRequest(f"response_format.type {response_format.type!r} is not one of "
                             "'text', 'json_object', 'json_schema'", param="response_format")
    json_schema = response_format.json_schema
    if json_schema is None or json_schema.schema_ is None:
        raise InvalidRequest("response_format json_schema needs json_schema.schema",
                             param="response_format")
    return GrammarSpec(kind="json_schema",
                       source=msgspec.json.encode(json_schema.schema_).decode())


def completion_output(request: CompletionRequest) -> Output:
    if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must lie in [0, {MAX_LOGPROBS}]", param="logprobs")
    grammar, param = output_constraint(request)
    return Output(logprobs=request.logprobs, echo=bool(request.echo), grammar=grammar,
                  grammar_param=param, num_candidates=_num_candidates(request))


def _num_candidates(request: CompletionRequest) -> int | None:
    """`best_of` when it asks for more candidates than n (None: n choices, each returned).
    As OpenAI's: at least n, and not streamed then (which candidates are best is known
    only at the end)."""
    best_of, n = request.best_of, request.n or 1
    if best_of is None or best_of == n:
        return None
    if not 1 <= best_of <= MAX_CHOICES:
        raise InvalidRequest(f"best_of must lie in [1, {MAX_CHOICES}]", param="best_of")
    if best_of < n:
        raise InvalidRequest("best_of must be at least n", param="best_of")
    if request.stream:
        raise InvalidRequest("best_of greater than n cannot be streamed", param="best_of")
    return best_of


def chat_output(request: ChatCompletionRequest, tools: ToolUse | None = None) -> Output:
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequest(f"top_logprobs must lie in [0, {MAX_LOGPROBS}]",
                             param="top_logprobs")
    if top is not None and not request.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true", param="top_logprobs")
    grammar, param = output_constraint(request)
    if (forced := forced_tool_grammar(request, tools)) is not None:
        if grammar is not None:
            raise InvalidRequest(f"a forced tool call and {param} cannot be combined",
                                 param="tool_choice")
        grammar, param = forced, "tools"
    return Output(logprobs=(top or 0) if request.logprobs else None, grammar=grammar,
                  grammar_param=param, tools=tools)


def validate(
    request: _GenerationParams,
    prompt_token_ids: list[int],
    limits: Limits,
    *,
    default_max_tokens: int | None,
    output: Output = Output(),
    echo_text: str | None = None,
    choice_index: int = 0,
) -> ParsedRequest:
    """Check every limit and build the sampling parameters of one prompt (its tokens left
    truncated first when `truncate_prompt_tokens` asks)."""
    if request.model != limits.model:
        raise ModelNotFound(f"The model `{request.model}` does not exist", param="model")
    if not 1 <= (1 if request.n is None else request.n) <= MAX_CHOICES:
        raise InvalidRequest(f"n must lie in [1, {MAX_CHOICES}]", param="n")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true",
                             param="stream_options")  # as OpenAI and vLLM answer
    _check_prompt_logprobs(request)
    max_tokens = _max_tokens(request)
    prompt_token_ids = _truncated(prompt_token_ids, request.truncate_prompt_tokens,
                                  limits.max_model_len - max(1, max_tokens or 1))
    _check_prompt(prompt_token_ids, limits)
    is_prompt_only = max_tokens == 0 and output.echo
    room = limits.max_model_len - len(prompt_token_ids)
    if max_tokens is not None and max_tokens <= 0 and not is_prompt_only:
        echo_note = " (0 only with echo)" if isinstance(request, CompletionRequest) else ""
        raise InvalidRequest(f"max_tokens must be at least 1{echo_note}", param="max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)} and max_tokens asks for {max_tokens} more",
            param="max_tokens",
        )
    # A prompt-only request still runs one step: the prompt's logprobs come with it.
    resolved = 1 if is_prompt_only else max_tokens or min(default_max_tokens or room, room)
    return ParsedRequest(
        model=request.model,
        prompt_token_ids=prompt_token_ids,
        sampling=_sampling(request, resolved, limits, output),
        stop=_stop_strings(request.stop),
        is_stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        usage_on_every_chunk=bool(request.stream_options
                                  and request.stream_options.continuous_usage_stats),
        choice_index=choice_index,
        echo=echo_text if output.echo else None,
        is_prompt_only=is_prompt_only,
        skip_special_tokens=request.skip_special_tokens is not False,
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        tools=output.tools,
        num_returned=(request.n or 1) if output.num_candidates else None,
        prompt_logprobs=request.prompt_logprobs,
    )


def _check_prompt_logprobs(request: _GenerationParams) -> None:
    """vLLM's `prompt_logprobs`: 0..20 alternatives, in a whole response only (as vLLM,
    which answers -1, the whole vocabulary, refused here: a list that long per token)."""
    count = request.prompt_logprobs
    if count is None:
        return
    if not 0 <= count <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must lie in [0, {MAX_LOGPROBS}]",
                             param="prompt_logprobs")
    if request.stream:
        raise InvalidRequest("prompt_logprobs are not available when stream is true",
                             param="prompt_logprobs")


def _max_tokens(request: _GenerationParams) -> int | None:
    """`max_completion_tokens` (the newer name) or `max_tokens`; both must then agree."""
    newer, older = request.max_completion_tokens, request.max_tokens
    if newer is not None and older is not None and newer != older:
        raise InvalidRequest("max_tokens and max_completion_tokens differ; send one",
                             param="max_completion_tokens")
    return newer if newer is not None else older


def _truncated(prompt_token_ids: list[int], keep: int | None, room: int) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's `truncate_prompt_tokens`); -1 keeps what
    leaves `room` for the output asked for (vLLM keeps the whole context, which then
    leaves none)."""
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = room
    if keep < 1:
        raise InvalidRequest("truncate_prompt_tokens must be -1 or at least 1",
                             param="truncate_prompt_tokens")
    return prompt_token_ids[-keep:]


def _check_prompt(prompt_token_ids: list[int], limits: Limits) -> None:
    if not prompt_token_ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if len(prompt_token_ids) >= limits.max_model_len:  # first: the cheaper check
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)}",
            param="prompt",
        )
    if any(t < 0 or t >= limits.vocab_size for t in prompt_token_ids):
        raise InvalidRequest(
            f"token ids must lie in [0, {limits.vocab_size})", param="prompt"
        )


def _sampling(request: _GenerationParams, max_tokens: int, limits: Limits,
              output: Output) -> SamplingParams:
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    _check_range("temperature", temperature, 0.0, 2.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("top_p must lie in (0, 1]", param="top_p")
    # top_k of -1 or 0 means "off" in vLLM's API; accept both for compatibility.
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else None
    if request.top_k is not None and request.top_k < -1:
        raise InvalidRequest("top_k must be -1, 0 (off) or positive", param="top_k")
    presence = request.presence_penalty or 0.0
    frequency = request.frequency_penalty or 0.0
    repetition = 1.0 if request.repetition_penalty is None else request.repetition_penalty
    min_p = request.min_p or 0.0
    _check_range("presence_penalty", presence, -2.0, 2.0)
    _check_range("frequency_penalty", frequency, -2.0, 2.0)
    _check_range("min_p", min_p, 0.0, 1.0)
    if not 0.0 < repetition <= 2.0:
        raise InvalidRequest("repetition_penalty must lie in (0, 2]",
                             param="repetition_penalty")
    min_tokens = request.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest("min_tokens must lie in [0, max_tokens]", param="min_tokens")
    stop_token_ids = tuple(request.stop_token_ids or ())
    if any(not 0 <= t < limits.vocab_size for t in stop_token_ids):
        raise InvalidRequest(f"stop_token_ids must lie in [0, {limits.vocab_size})",
                             param="stop_token_ids")
    # best_of ranks its candidates by their tokens' logprobs, asked for or not.
    logprobs = 0 if output.logprobs is None and output.num_candidates else output.logprobs
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=request.seed, stop_token_ids=stop_token_ids, ignore_eos=bool(request.ignore_eos),
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        logit_bias=_logit_bias(request.logit_bias, limits), min_p=min_p,
        min_tokens=min_tokens, logprobs=logprobs,
        prompt_logprobs=_prompt_logprobs(request, output), grammar=output.grammar,
        n=output.choices_per_prompt(request.n),
    )


def _prompt_logprobs(request: _GenerationParams, output: Output) -> int | None:
    """Alternatives per prompt token to compute: for `echo` with `logprobs`, for
    `prompt_logprobs`, the more of the two; None when neither asks."""
    counts = [c for c in (output.logprobs if output.echo else None, request.prompt_logprobs)
              if c is not None]
    return max(counts) if counts else None


def _check_range(param: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"{param} must lie in [{low:g}, {high:g}]", param=param)


def _logit_bias(bias: dict[str, float] | None, limits: Limits
                ) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id (as a string) to a bias in [-100, 100]."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens",
                             param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not key.strip().isdigit() or not 0 <= int(key) < limits.vocab_size:
            raise InvalidRequest(f"logit_bias key {key!r} is not a token id in "
                                 f"[0, {limits.vocab_size})", param="logit_bias")
        if not -100.0 <= value <= 100.0:
            raise InvalidRequest(f"logit_bias[{key}] must lie in [-100, 100]",
                                 param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    if any(not s for s in stops):
        raise InvalidRequest("stop strings must not be empty", param="stop")
    return stops


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }
