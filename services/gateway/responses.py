"""Response bodies and stream chunks of the two generation routes, with their logprobs.

A response has one choice per prompt; `Choice` gathers one choice's chunks (for a whole body)
and its running text offset (for completions' `text_offset`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from services.gateway.call_arguments import CallStream, cut_calls
from services.gateway.text_chunks import TextChunk
from services.gateway.tokenizer import Tokenizer
from services.gateway.tool_calls import ToolCall, ToolUse
from services.gateway.validation import ParsedRequest
from shared.messages import FinishReason, TokenLogprob


@dataclass
class Choice:
    index: int
    num_prompt_tokens: int  # counted in usage: 0 for a prompt's choices after its first
    prompt_token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # when asked (vLLM's)
    finish_reason: FinishReason | None = None
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    text_offset: int = 0  # characters of this choice's text before the next chunk
    num_chunks: int = 0  # added so far (a stream opens each choice at its first)
    tools: ToolUse | None = None  # chat with tools: calls to find in the text
    call_stream: CallStream | None = None

    def __post_init__(self) -> None:
        if self.tools is not None:
            self.call_stream = CallStream(self.tools)

    def add(self, chunk: TextChunk, *, keeps_output: bool = True) -> None:
        """Count the chunk; keep its text and tokens too for a whole body (`keeps_output`),
        which a stream, already sent, does not need."""
        self.num_chunks += 1
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if keeps_output:
            self.texts.append(chunk.text)
            self.token_ids += chunk.token_ids
            if self.logprobs is not None and chunk.logprobs is not None:
                self.logprobs += chunk.logprobs
            else:
                self.logprobs = None
        self.finish_reason = chunk.finish_reason
        self.num_completion_tokens = chunk.num_completion_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def cumulative_logprob(self) -> float:
        """The sum of its tokens' logprobs (with `echo` the prompt's too, the same for every
        choice of a prompt); 0 without logprobs."""
        return sum(e.logprob or 0.0 for e in self.logprobs or ())


def best_choices(choices: list[Choice], parsed: list[ParsedRequest]) -> list[Choice]:
    """The choices to return: with `best_of`, each prompt's `num_returned` candidates of
    highest cumulative logprob (ties in candidate order), numbered on from 0 per prompt;
    else all of them."""
    if parsed[0].num_returned is None:
        return choices
    kept = []
    for prompt, one in enumerate(parsed):
        size, num_returned = one.sampling.n, one.num_returned or 1
        candidates = choices[one.choice_index:one.choice_index + size]
        ranked = sorted(candidates, key=lambda c: -c.cumulative_logprob)[:num_returned]
        for rank, choice in enumerate(ranked):
            kept.append(dataclasses.replace(
                choice, index=prompt * num_returned + rank,
                num_prompt_tokens=len(one.prompt_token_ids) if rank == 0 else 0))
    return kept


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def total_usage(choices: list[Choice]) -> dict[str, Any]:
    """Usage of the whole response: every prompt once, every choice's output."""
    return usage(sum(c.num_prompt_tokens for c in choices),
                 sum(c.num_completion_tokens for c in choices),
                 sum(c.num_cached_tokens for c in choices if c.num_prompt_tokens))


class TokenText:
    """Token strings and bytes, as logprobs spell them."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)  # noqa: B019 (one per gateway, lives as long)
    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))

    def entries(self, token_ids: list[int], logprobs: list[TokenLogprob]
                ) -> list[dict[str, Any]]:
        """Logprobs as chat and the Responses API spell them: `token`, `logprob`, `bytes`,
        `top_logprobs` of the same."""
        return [{**self._entry(t, e.logprob or 0.0),
                 "top_logprobs": [self._entry(top, value) for top, value in e.top]}
                for t, e in zip(token_ids, logprobs, strict=True)]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": self.text(token_id), "logprob": logprob, "bytes": self.bytes(token_id)}

    def scored_prompt(self, choice: Choice, count: int | None) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` field, when asked (`count`): per prompt token None for
        the first, else a map of token id (as a string) to `logprob`, `rank` and
        `decoded_token`: the prompt's own token first, then the `count` most likely. None
        in place of the list where the engine gave none (a simulated one)."""
        if count is None:
            return {}
        entries = choice.prompt_logprobs
        if entries is None:
            return {"prompt_logprobs": None}
        scored: list[dict[str, Any] | None] = []
        for token_id, entry in zip(choice.prompt_token_ids, entries, strict=False):
            if entry.logprob is None:
                scored.append(None)
                continue
            position = {str(token_id): self._scored(token_id, entry.logprob, entry.rank)}
            for rank, (top_id, logprob) in enumerate(entry.top[:count], start=1):
                position.setdefault(str(top_id), self._scored(top_id, logprob, rank))
            scored.append(position)
        return {"prompt_logprobs": scored}

    def _scored(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": logprob, "rank": rank, "decoded_token": self.text(token_id)}


class TokenIdText(TokenText):
    """Tokens named `token_id:N` in logprobs (vLLM's `return_tokens_as_token_ids`): exact
    where a token's text is not (one byte of a multi-byte character, two ids that decode
    alike); `bytes` stay the token's own."""

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def token_ids_fields(is_wanted: bool, token_ids: list[int],
                     prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """vLLM's `return_token_ids` fields of a choice: its output ids (of the chunk, when
    streamed) and the prompt's (when given: a body, a choice's first chunk)."""
    if not is_wanted:
        return {}
    fields: dict[str, Any] = {} if prompt_token_ids is None \
        else {"prompt_token_ids": prompt_token_ids}
    return {**fields, "token_ids": token_ids}


class _Format:
    """What the client asked to get back beside the text: logprobs, token ids, and
    `prompt_logprobs` (alternatives per prompt token; None: not asked)."""

    def __init__(self, request_id: str, model: str, tokens: TokenText,
                 wants_logprobs: bool, wants_token_ids: bool = False,
                 prompt_logprobs: int | None = None) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.tokens, self.wants_logprobs = tokens, wants_logprobs
        self.wants_token_ids = wants_token_ids
        self.prompt_logprobs = prompt_logprobs


class CompletionFormat(_Format):
    """Bodies of `/v1/completions`; logprobs as `tokens`, `token_logprobs`, `top_logprobs`
    (token -> logprob, the chosen token included), `text_offset`; with `wants_token_ids`,
    each choice's `prompt_token_ids` and `token_ids`; with `prompt_logprobs`, each
    choice's."""

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, **extra}

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        return None

    def chunk(self, choice: Choice, chunk: TextChunk) -> dict[str, Any] | None:
        """The chunk to send, or None when it would say nothing (its text held back)."""
        logprobs = self._logprobs(choice, chunk.token_ids, chunk.logprobs)
        is_first = choice.num_chunks == 1
        if not chunk.text and logprobs is None and chunk.finish_reason is None \
                and not (self.wants_token_ids and (chunk.token_ids or is_first)):
            return None
        ids = token_ids_fields(self.wants_token_ids, chunk.token_ids,
                               choice.prompt_token_ids if is_first else None)
        return self._envelope([{"index": choice.index, "text": chunk.text,
                                "logprobs": logprobs, "finish_reason": chunk.finish_reason,
                                **ids}])

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return self._envelope([], usage=usage_body)

    def body(self, choices: list[Choice], usage_of: list[Choice] | None = None
             ) -> dict[str, Any]:
        """The whole response; usage counts `usage_of` (best_of's every candidate) if given,
        else `choices`."""
        return self._envelope([
            {"index": c.index, "text": c.text,
             "logprobs": self._logprobs(c, c.token_ids, c.logprobs),
             "finish_reason": c.finish_reason,
             **token_ids_fields(self.wants_token_ids, c.token_ids, c.prompt_token_ids),
             **self.tokens.scored_prompt(c, self.prompt_logprobs)}
            for c in choices
        ], usage=total_usage(usage_of or choices))

    def _logprobs(self, choice: Choice, token_ids: list[int],
                  entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not self.wants_logprobs or entries is None:
            return None
        strings = [self.tokens.text(t) for t in token_ids]
        offsets = []
        for string in strings:
            offsets.append(choice.text_offset)
            choice.text_offset += len(string)
        return {
            "tokens": strings,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [
                None if e.logprob is None else
                {**{self.tokens.text(t): v for t, v in e.top}, string: e.logprob}
                for e, string in zip(entries, strings, strict=True)
            ],
            "text_offset": offsets,
        }


class ChatFormat(_Format):
    """Bodies of `/v1/chat/completions`; logprobs as `content[]` of `token`, `logprob`,
    `bytes`, `top_logprobs`; with `wants_token_ids`, the response's `prompt_token_ids` (in
    a stream, on each choice's opening chunk) and each choice's `token_ids`; with
    `prompt_logprobs`, the response's (as vLLM's)."""

    def _chunk_envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": "chat.completion.chunk",
                "created": self.created, "model": self.model, "choices": choices, **extra}

    def opening(self, choice: Choice) -> dict[str, Any] | None:
        prompt = {"prompt_token_ids": choice.prompt_token_ids} if self.wants_token_ids else {}
        return self._chunk_envelope([{"index": choice.index,
                                      "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}], **prompt)

    def chunk(self, choice: Choice, chunk: TextChunk) -> dict[str, Any] | None:
        """The chunk to send, or None when it would say nothing (text that may be a call
        or a stop string, held back)."""
        text, finish = chunk.text, chunk.finish_reason
        calls: list[dict[str, Any]] = []
        if (stream := choice.call_stream) is not None:  # text that may be a call is held
            text, calls = stream.push(text)
            if finish is not None:
                rest, unsent = stream.finish(is_cut=finish == "length")
                text, calls = text + rest, calls + unsent
                finish = "tool_calls" if stream.has_calls and finish != "length" else finish
        delta: dict[str, Any] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        logprobs = self._logprobs(chunk.token_ids, chunk.logprobs)
        if not delta and logprobs is None and finish is None \
                and not (self.wants_token_ids and chunk.token_ids):
            return None
        return self._chunk_envelope([{"index": choice.index, "delta": delta,
                                      "logprobs": logprobs, "finish_reason": finish,
                                      **token_ids_fields(self.wants_token_ids,
                                                         chunk.token_ids)}])

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return self._chunk_envelope([], usage=usage_body)

    def body(self, choices: list[Choice], usage_of: list[Choice] | None = None
             ) -> dict[str, Any]:
        prompt = {"prompt_token_ids": choices[0].prompt_token_ids} \
            if self.wants_token_ids else {}
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [self._choice_body(c) for c in choices],
                "usage": total_usage(usage_of or choices), **prompt,
                **self.tokens.scored_prompt(choices[0], self.prompt_logprobs)}

    def _choice_body(self, choice: Choice) -> dict[str, Any]:
        content: str | None = choice.text
        calls: list[ToolCall] = []
        finish = choice.finish_reason
        if choice.tools is not None:
            content, calls = choice.tools.parse(choice.text)
            if not calls and finish == "length":  # cut inside a call: as it streams
                content, calls = cut_calls(choice.tools, choice.text)
        # `refusal` is required in OpenAI's schema of this message (null: none made).
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls or (choice.tools is not None and choice.tools.is_forced):
            message["content"] = content or None  # as OpenAI: null beside calls
        if calls:
            message["tool_calls"] = [call.body() for call in calls]
        return {"index": choice.index, "message": message,
                "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
                "finish_reason": "tool_calls" if calls and finish != "length" else finish,
                **token_ids_fields(self.wants_token_ids, choice.token_ids)}

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprob] | None
                  ) -> dict[str, Any] | None:
        if not self.wants_logprobs or entries is None:
            return None
        return {"content": self.tokens.entries(token_ids, entries), "refusal": None}


ResponseFormat = CompletionFormat | ChatFormat
