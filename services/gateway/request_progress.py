"""What one request has produced and when, as its client sees it: the latency metrics
(TTFT, inter-token, end to end) and the figures of its public lifecycle events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.gateway.request_stream import RequestStream
from shared.errors import RequestMoved, WorkerLost
from shared.messages import FinishReason
from shared.metrics import GatewayMetrics

# Continuations per request after lost workers; past this the client gets the error.
MAX_FAILOVERS = 2
# Continuations after the request was handed back to be placed again.
MAX_MOVES = 8


class TokenClock:
    """TTFT, inter-token latency and end-to-end latency of one request, as the client sees
    them (tokens leave the gateway as they arrive)."""

    def __init__(self, metrics: GatewayMetrics, *, observes_latency: bool = True) -> None:
        self.metrics = metrics
        self.observes_latency = observes_latency
        self.started_at = time.perf_counter()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.num_gaps = 0
        self.gap_sum_s = 0.0
        self.gap_max_s = 0.0

    def tick(self, num_tokens: int) -> None:
        now = time.perf_counter()
        if self.last_at is None:
            self.first_at = now
            if self.observes_latency:
                self.metrics.ttft.observe(now - self.started_at)
        else:
            gap_s = now - self.last_at
            if self.observes_latency:
                self.metrics.itl.observe(gap_s)
            self.num_gaps += 1
            self.gap_sum_s += gap_s
            self.gap_max_s = max(self.gap_max_s, gap_s)
        self.metrics.generation_tokens.inc(num_tokens)
        self.last_at = now

    def finish(self) -> None:
        if self.last_at is not None and self.observes_latency:
            self.metrics.e2e.observe(self.last_at - self.started_at)

    def timings(self) -> dict[str, float | None]:
        """The `RequestEvent` timing fields, so far."""
        return {
            "ttft_s": None if self.first_at is None else self.first_at - self.started_at,
            "e2e_s": time.perf_counter() - self.started_at,
            "itl_mean_s": self.gap_sum_s / self.num_gaps if self.num_gaps else None,
            "itl_max_s": self.gap_max_s if self.num_gaps else None,
        }


@dataclass
class Progress:
    """What one request has produced so far, for the stream and its public events."""

    generated: list[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    num_lost: int = 0  # continuations after a worker was lost
    num_moved: int = 0  # and after the request was handed back

    def may_continue_after(self, exc: WorkerLost) -> bool:
        """Count the interruption; whether the request goes on elsewhere. A request that
        kills every worker it lands on takes down at most `MAX_FAILOVERS` more. Being
        handed back (`RequestMoved`: load shed, a stream its worker no longer holds, a
        conductor lost while placing it) is nothing the request may have caused, so it has
        a limit of its own, against a request passed back and forth forever."""
        if isinstance(exc, RequestMoved):
            self.num_moved += 1
            return self.num_moved <= MAX_MOVES
        self.num_lost += 1
        return self.num_lost <= MAX_FAILOVERS

    def workers(self, stream: RequestStream) -> dict[str, str]:
        placed = stream.placement
        if placed is None:
            return {}
        return {"prefill_worker_id": placed.prefill_worker_id,
                "decode_worker_id": placed.decode_worker_id}
