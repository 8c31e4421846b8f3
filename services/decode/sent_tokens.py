"""What a decode worker sent for each request, so that it can send it again.

Token batches travel on core NATS (at most once): across a NATS restart some never reach
the gateway, which then asks, with `StreamResume`, for everything from the first token it
lacks. The worker keeps each running request's output token ids (the first one is
prefill's, from `KvCommitted`), and a finished request's for `keep_s` after its end, since
its last batch may be the one that was lost.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shared.messages import FinishReason, GenerateRequest, ResumePoint, TokenDelta, TokenLogprob


@dataclass
class SentStream:
    request: GenerateRequest
    token_ids: list[int]  # output indexes request.output_offset, +1, ...
    logprobs: list[TokenLogprob | None]  # one per token when the request asked for them
    finish_reason: FinishReason | None = None
    finished_at: float = 0.0

    def since(self, next_index: int) -> TokenDelta | None:
        """Every token from output index `next_index` on (with the finish, if it ended);
        None when there is nothing newer."""
        start = next_index - self.request.output_offset
        if start < 0 or start >= len(self.token_ids):
            return None
        logprobs = self.logprobs[start:]
        return TokenDelta(request_id=self.request.request_id, index=next_index,
                          token_ids=self.token_ids[start:], finish_reason=self.finish_reason,
                          logprobs=logprobs if None not in logprobs else None)  # type: ignore[arg-type]


class SentTokens:
    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self._streams: dict[str, SentStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request: GenerateRequest, token_ids: list[int],
             logprobs: list[TokenLogprob | None] | None = None) -> None:
        self._streams[request.request_id] = SentStream(
            request, list(token_ids), list(logprobs or [None] * len(token_ids)))

    def record(self, request_id: str, token_id: int, finish_reason: FinishReason | None,
               logprob: TokenLogprob | None = None) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.token_ids.append(token_id)
        stream.logprobs.append(logprob)
        if finish_reason is not None:
            stream.finish_reason = finish_reason
            stream.finished_at = time.monotonic()

    def num_sent(self, request_id: str) -> int:
        """Output tokens sent for the request (0 when not followed)."""
        stream = self._streams.get(request_id)
        return 0 if stream is None else len(stream.token_ids)

    def has(self, request_id: str) -> bool:
        return request_id in self._streams

    def request(self, request_id: str) -> GenerateRequest | None:
        stream = self._streams.get(request_id)
        return None if stream is None else stream.request

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def resend(self, point: ResumePoint) -> TokenDelta | None:
        stream = self._streams.get(point.request_id)
        return None if stream is None else stream.since(point.next_index)

    def expire(self, now_s: float | None = None) -> None:
        """Forget finished streams older than `keep_s`."""
        cutoff = (time.monotonic() if now_s is None else now_s) - self.keep_s
        for request_id, stream in list(self._streams.items()):
            if stream.finish_reason is not None and stream.finished_at < cutoff:
                del self._streams[request_id]
