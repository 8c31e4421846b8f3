"""What a choice's stream yields: `TextChunk`s, each the text new since the last one and the
tokens (and logprobs) it came from, gathered by a `PendingChunk` while a token completes no
character yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.validation import ParsedRequest
from shared.messages import FinishReason, TokenDelta, TokenLogprob


@dataclass(frozen=True)
class TextChunk:
    """New text of one choice. `token_ids` are the tokens it came from (with `echo`, the
    first chunk starts with the prompt's), and `logprobs` one entry each when asked."""

    text: str
    finish_reason: FinishReason | None
    num_completion_tokens: int
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served (first placement)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first, when asked


class PendingChunk:
    """Tokens (and their logprobs) not yet in a chunk: a token that completes no character
    yields no text, so its chunk waits for the next one."""

    def __init__(self, parsed: ParsedRequest) -> None:
        self.wants_logprobs = parsed.sampling.logprobs is not None
        self.wants_prompt_logprobs = parsed.sampling.prompt_logprobs is not None
        self.wants_scored_prompt = parsed.prompt_logprobs is not None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.echo = parsed.echo
        self.prompt_token_ids = parsed.prompt_token_ids
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if self.wants_logprobs else None

    def add_prompt(self, delta: TokenDelta) -> None:
        """With `echo`: the prompt's tokens (and logprobs, when asked) lead the choice. With
        `prompt_logprobs`, the prompt's logprobs go with the first chunk."""
        if self.wants_scored_prompt:
            self.prompt_logprobs = delta.prompt_logprobs
        if self.echo is None:
            return
        self.token_ids += self.prompt_token_ids
        if self.logprobs is not None and self.wants_prompt_logprobs:
            if delta.prompt_logprobs is None:
                self.logprobs = None  # the engine has none to give (a simulated one)
            else:
                self.logprobs += delta.prompt_logprobs

    def add(self, delta: TokenDelta) -> None:
        self.token_ids += delta.token_ids
        if self.logprobs is not None:
            if delta.logprobs is None:
                self.logprobs = None
            else:
                self.logprobs += delta.logprobs

    def take(self, text: str, finish: FinishReason | None, num_completion: int,
             num_cached: int) -> TextChunk:
        if self.echo is not None:
            text, self.echo = self.echo + text, None
        chunk = TextChunk(text, finish, num_completion, num_cached, self.token_ids,
                          self.logprobs, self.prompt_logprobs)
        self.token_ids, self.prompt_logprobs = [], None
        self.logprobs = [] if self.wants_logprobs and self.logprobs is not None else None
        return chunk
