"""The gateway's per-request stream table.

Token deltas for one request reach the gateway from two workers (the first token from
prefill, the rest from decode) over different connections, so they can arrive out of order.
Each `RequestStream` puts them back in order by their `index` before the handler sees them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from shared.errors import HalfmoonError, RequestTimeout, WorkerLost, error_from_code
from shared.logs import get_logger
from shared.messages import GatewayEvent, RequestFailed, RequestPlaced, TokenBatch, TokenDelta

log = get_logger(__name__)


class RequestStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.is_finished = False
        self.placement: RequestPlaced | None = None
        self._next_index = 0
        self._early: dict[int, TokenDelta] = {}
        self._queue: asyncio.Queue[TokenDelta | HalfmoonError] = asyncio.Queue()

    def deliver(self, delta: TokenDelta) -> None:
        if delta.index < self._next_index or self.is_finished:
            return  # a duplicate, or late after the end
        self._early[delta.index] = delta
        while (ready := self._early.pop(self._next_index, None)) is not None:
            self._next_index += len(ready.token_ids)
            self._queue.put_nowait(ready)
            if ready.finish_reason is not None:
                self.is_finished = True
                self._early.clear()
                return

    def fail(self, error: HalfmoonError) -> None:
        self._queue.put_nowait(error)

    def lost_worker(self, is_alive: Callable[[str], bool]) -> str | None:
        """The worker this request still depends on that stopped heartbeating: decode
        always, prefill until the first token is in. (A draining worker is alive.)"""
        placement = self.placement
        if placement is None or self.is_finished:
            return None
        if not is_alive(placement.decode_worker_id):
            return placement.decode_worker_id
        if self._next_index == 0 and not is_alive(placement.prefill_worker_id):
            return placement.prefill_worker_id
        return None

    async def next(self, timeout_s: float) -> TokenDelta:
        """The next delta in order; raises the request's error, or `RequestTimeout` when
        nothing arrives for `timeout_s`."""
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError as exc:
            raise RequestTimeout(
                f"request {self.request_id} made no progress for {timeout_s}s"
            ) from exc
        if isinstance(item, HalfmoonError):
            raise item
        return item


class StreamTable:
    """Open streams by request id; `dispatch` routes events from NATS to them."""

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def dispatch(self, event: GatewayEvent) -> None:
        match event:
            case TokenBatch(items=items):
                for delta in items:
                    if (stream := self._streams.get(delta.request_id)) is not None:
                        stream.deliver(delta)
            case RequestFailed(request_id=request_id, code=code, message=message,
                               retry_after_s=retry_after_s):
                if (stream := self._streams.get(request_id)) is not None:
                    stream.fail(error_from_code(code, message, retry_after_s))
            case RequestPlaced(request_id=request_id):
                if (stream := self._streams.get(request_id)) is not None:
                    stream.placement = event

    def fail_lost(self, is_alive: Callable[[str], bool]) -> int:
        """Fail every stream whose worker was lost with `WorkerLost` (its reader places it
        again); return how many."""
        count = 0
        for stream in self._streams.values():
            if (worker_id := stream.lost_worker(is_alive)) is not None:
                stream.placement = None  # until the new placement arrives
                stream.fail(WorkerLost(f"worker {worker_id} stopped answering"))
                count += 1
        return count

    def fail_all(self, error: HalfmoonError) -> None:
        for stream in self._streams.values():
            stream.fail(error)
