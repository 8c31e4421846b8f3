"""OpenAI request schemas, their validation into one internal form, and response bodies."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from shared.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from shared.messages import FinishReason, SamplingParams

MAX_STOP_STRINGS = 4
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _GenerationParams(msgspec.Struct, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_GenerationParams, kw_only=True):
    prompt: str | list[int | str]


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationParams, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


@dataclass(frozen=True)
class Limits:
    model: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request, ready to publish."""

    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    is_stream: bool
    include_usage: bool


T = TypeVar("T")

_PATH = re.compile(r"at `\$\.([A-Za-z_]+)")


def decode_body(body: bytes, schema: type[T]) -> T:
    """Decode JSON into `schema`; any problem becomes `InvalidRequest` naming the field."""
    if not body.strip():
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise InvalidRequest(str(exc), param=match.group(1) if match else None) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"invalid JSON: {exc}") from exc


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The prompt text or token ids. Only one prompt per request (like `n == 1`)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if all(isinstance(p, int) for p in prompt) and prompt:
        return [int(p) for p in prompt]
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, or a list holding one string",
        param="prompt",
    )


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template, with text parts joined."""
    if not request.messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    rendered = []
    for i, message in enumerate(request.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role {message.role!r} is not one of {sorted(CHAT_ROLES)}",
                param="messages",
            )
        rendered.append({"role": message.role, "content": _message_text(message, i)})
    return rendered


def _message_text(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(
                f"messages[{i}].content: only text parts are supported, got {part.type!r}",
                param="messages",
            )
        texts.append(part.text)
    return "".join(texts)


def validate(
    request: _GenerationParams,
    prompt_token_ids: list[int],
    limits: Limits,
    *,
    default_max_tokens: int | None,
    max_tokens: int | None,
) -> ParsedRequest:
    """Check every limit and build the sampling parameters."""
    if request.model != limits.model:
        raise ModelNotFound(f"The model `{request.model}` does not exist", param="model")
    if request.n not in (None, 1):
        raise InvalidRequest("only n=1 is supported", param="n")
    _check_prompt(prompt_token_ids, limits)
    room = limits.max_model_len - len(prompt_token_ids)
    if max_tokens is not None and max_tokens <= 0:
        raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)} and max_tokens asks for {max_tokens} more",
            param="max_tokens",
        )
    resolved = max_tokens or min(default_max_tokens or room, room)
    return ParsedRequest(
        model=request.model,
        prompt_token_ids=prompt_token_ids,
        sampling=_sampling(request, resolved),
        stop=_stop_strings(request.stop),
        is_stream=bool(request.stream),
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
    )


def _check_prompt(prompt_token_ids: list[int], limits: Limits) -> None:
    if not prompt_token_ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if any(t < 0 or t >= limits.vocab_size for t in prompt_token_ids):
        raise InvalidRequest(
            f"token ids must lie in [0, {limits.vocab_size})", param="prompt"
        )
    if len(prompt_token_ids) >= limits.max_model_len:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt "
            f"has {len(prompt_token_ids)}",
            param="prompt",
        )


def _sampling(request: _GenerationParams, max_tokens: int) -> SamplingParams:
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequest("temperature must lie in [0, 2]", param="temperature")
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("top_p must lie in (0, 1]", param="top_p")
    # top_k of -1 or 0 means "off" in vLLM's API; accept both for compatibility.
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else None
    if request.top_k is not None and request.top_k < -1:
        raise InvalidRequest("top_k must be -1, 0 (off) or positive", param="top_k")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        seed=request.seed,
    )


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


class CompletionFormat:
    """Bodies of `/v1/completions`."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def chunk(self, text: str, finish_reason: FinishReason | None) -> dict[str, Any]:
        return self._envelope([{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish_reason}])

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return self._envelope([], usage=usage_body)

    def body(self, text: str, finish_reason: FinishReason | None,
             usage_body: dict[str, Any]) -> dict[str, Any]:
        return self._envelope([{"index": 0, "text": text, "logprobs": None,
                                "finish_reason": finish_reason}], usage=usage_body)


class ChatFormat:
    """Bodies of `/v1/chat/completions`."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def _chunk_envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.model, "choices": choices, **extra}

    def first_chunk(self) -> dict[str, Any] | None:
        return self._chunk_envelope([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])

    def chunk(self, text: str, finish_reason: FinishReason | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._chunk_envelope([{"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}])

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return self._chunk_envelope([], usage=usage_body)

    def body(self, text: str, finish_reason: FinishReason | None,
             usage_body: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish_reason}],
                "usage": usage_body}
