"""A decoded OpenAI request, checked against the served model's limits and turned into one
internal form per prompt (`ParsedRequest`: token ids, `SamplingParams`, stop strings, what
to send back). Every refusal is a typed error naming the field (`param`): 400 at the gateway,
404 for a model not served.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from services.gateway.guided import guided_grammar
from services.gateway.model_info import OPENAI_SAMPLING, SamplingDefaults
from services.gateway.openai_schema import (
    MAX_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationParams,
    ResponseFormat,
    forced_tool_grammar,
)
from services.gateway.token_filters import allowed_token_ids
from services.gateway.tool_calls import ToolUse
from shared.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    UnsupportedParameter,
)
from shared.messages import GrammarSpec, SamplingParams


@dataclass(frozen=True)
class Limits:
    model: str
    max_model_len: int
    vocab_size: int
    # What a request that leaves a sampling field out gets (`--sampling-defaults`).
    sampling_defaults: SamplingDefaults = OPENAI_SAMPLING


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
    priority: int = 0  # vLLM's: lower first where requests wait (`GenerateRequest.priority`)


@dataclass(frozen=True)
class Output:
    """What the client asked to get back, beyond the text."""

    logprobs: int | None = None  # alternatives per token; None: no logprobs
    echo: bool = False
    grammar: GrammarSpec | None = None  # what the output must match
    grammar_param: str = "response_format"  # the field that asked for it
    tools: ToolUse | None = None
    num_candidates: int | None = None  # `best_of`, when it asks for more than n
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences the output must not write

    def choices_per_prompt(self, n: int | None) -> int:
        """Choices generated per prompt: `best_of`'s candidates, else n."""
        return self.num_candidates or n or 1


def output_constraint(request: GenerationParams) -> tuple[GrammarSpec | None, str]:
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
    request: GenerationParams,
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
    _check_fields(request)
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
    default = default_max_tokens or limits.sampling_defaults.max_tokens or room
    resolved = 1 if is_prompt_only else max_tokens or min(default, room)
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
        priority=request.priority or 0,
    )


def _check_prompt_logprobs(request: GenerationParams) -> None:
    """vLLM's `prompt_logprobs`: 0..20 alternatives, in a whole response only, as vLLM's;
    its -1 (the whole vocabulary at every prompt position) is refused here."""
    count = request.prompt_logprobs
    if count is None:
        return
    if not 0 <= count <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must lie in [0, {MAX_LOGPROBS}]",
                             param="prompt_logprobs")
    if request.stream:
        raise InvalidRequest("prompt_logprobs are not available when stream is true",
                             param="prompt_logprobs")


def _max_tokens(request: GenerationParams) -> int | None:
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


def _sampling(request: GenerationParams, max_tokens: int, limits: Limits,
              output: Output) -> SamplingParams:
    defaults = limits.sampling_defaults
    temperature = defaults.temperature if request.temperature is None else request.temperature
    top_p = defaults.top_p if request.top_p is None else request.top_p
    _check_range("temperature", temperature, 0.0, 2.0)
    _check_range("top_p", top_p, 0.0, 1.0)  # 0, as OpenAI takes it: the likeliest token
    presence = request.presence_penalty or 0.0
    frequency = request.frequency_penalty or 0.0
    repetition = (defaults.repetition_penalty if request.repetition_penalty is None
                  else request.repetition_penalty)
    min_p = defaults.min_p if request.min_p is None else request.min_p
    _check_range("presence_penalty", presence, -2.0, 2.0)
    _check_range("frequency_penalty", frequency, -2.0, 2.0)
    _check_range("min_p", min_p, 0.0, 1.0)
    if not 0.0 < repetition <= 2.0:
        raise InvalidRequest("repetition_penalty must lie in (0, 2]",
                             param="repetition_penalty")
    min_tokens = request.min_tokens or 0
    if not 0 <= min_tokens <= max_tokens:
        raise InvalidRequest("min_tokens must lie in [0, max_tokens]", param="min_tokens")
    # best_of ranks its candidates by their tokens' logprobs, asked for or not.
    logprobs = 0 if output.logprobs is None and output.num_candidates else output.logprobs
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p,
        top_k=_top_k(request.top_k, defaults), seed=_int64("seed", request.seed),
        stop_token_ids=_stop_token_ids(request.stop_token_ids, limits),
        ignore_eos=bool(request.ignore_eos),
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition,
        logit_bias=_logit_bias(request.logit_bias, limits), min_p=min_p,
        min_tokens=min_tokens, logprobs=logprobs,
        allowed_token_ids=allowed_token_ids(request.allowed_token_ids, limits.vocab_size),
        bad_words=output.bad_words,
        prompt_logprobs=_prompt_logprobs(request, output), grammar=output.grammar,
        n=output.choices_per_prompt(request.n),
    )


def _prompt_logprobs(request: GenerationParams, output: Output) -> int | None:
    """Alternatives per prompt token to compute: for `echo` with `logprobs`, for
    `prompt_logprobs`, the more of the two; None when neither asks."""
    counts = [c for c in (output.logprobs if output.echo else None, request.prompt_logprobs)
              if c is not None]
    return max(counts) if counts else None


def _check_fields(request: GenerationParams) -> None:
    """The checks of fields that need no prompt: choices, streaming, prompt logprobs, beam
    search (not served) and a priority of 64 bits (the gateway's policy decides whether
    one other than 0 is served)."""
    if not 1 <= (1 if request.n is None else request.n) <= MAX_CHOICES:
        raise InvalidRequest(f"n must lie in [1, {MAX_CHOICES}]", param="n")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true",
                             param="stream_options")  # as OpenAI and vLLM answer
    _check_prompt_logprobs(request)
    if request.use_beam_search:
        raise UnsupportedParameter("halfmoon does not serve beam search",
                                   param="use_beam_search")
    _int64("priority", request.priority)


def _top_k(top_k: int | None, defaults: SamplingDefaults) -> int | None:
    if top_k is None:
        return defaults.top_k
    if top_k < -1:
        raise InvalidRequest("top_k must be -1, 0 (off) or positive", param="top_k")
    return top_k if top_k > 0 else None  # -1 and 0 are vLLM's "off": both accepted


def _stop_token_ids(token_ids: list[int] | None, limits: Limits) -> tuple[int, ...]:
    if any(not 0 <= t < limits.vocab_size for t in token_ids or ()):
        raise InvalidRequest(f"stop_token_ids must lie in [0, {limits.vocab_size})",
                             param="stop_token_ids")
    return tuple(token_ids or ())


def _int64(param: str, value: int | None) -> int | None:
    """A 64-bit integer, as OpenAI's and vLLM's seeds are (past that range seeds would share
    streams)."""
    if value is not None and not -(2**63) <= value < 2**63:
        raise InvalidRequest(f"{param} must lie in [-2^63, 2^63 - 1]", param=param)
    return value


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


