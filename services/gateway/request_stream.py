"""The gateway's per-request stream table.

Token deltas for one request reach the gateway from two workers (the first token from
prefill, the rest from decode) over different connections, so they can arrive out of order.
Each `RequestStream` puts them back in order by their `index` before the handler sees them.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable

from shared.errors import (
    ErrorCode,
    HalfmoonError,
    RequestMoved,
    RequestTimeout,
    WorkerLost,
    error_from_code,
)
from shared.logs import get_logger
from shared.messages import (
    GatewayEvent,
    OpenStreams,
    OpenStreamsQuery,
    RequestFailed,
    RequestPlaced,
    ResumePoint,
    StreamQuery,
    StreamStatus,
    TokenBatch,
    TokenDelta,
)

log = get_logger(__name__)


class RequestStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.is_finished = False
        self.placement: RequestPlaced | None = None
        self.progressed_at = time.monotonic()  # the last new token, or the start
        self.resumed_at = 0.0  # the last `StreamResume` asked for it
        self.has_decoded = False  # a token came from the placement's decode worker
        self.lost_workers: set[str] = set()  # failed over from: their late failures are stale
        self.attempt = 0  # which placement of the request it follows (`GenerateRequest.attempt`)
        # The JetStream sequence of the message that queued its attempt in the request stream.
        self.queued_seq: int | None = None
        self._next_index = 0
        self._early: dict[int, TokenDelta] = {}
        self._queue: asyncio.Queue[TokenDelta | HalfmoonError] = asyncio.Queue()

    def deliver(self, delta: TokenDelta) -> None:
        if delta.index < self._next_index or self.is_finished:
            return  # a duplicate, or late after the end
        self._early[delta.index] = delta
        while (ready := self._early.pop(self._next_index, None)) is not None:
            self._next_index += len(ready.token_ids)
            self.progressed_at = time.monotonic()
            self._queue.put_nowait(ready)
            if ready.finish_reason is not None:
                self.is_finished = True
                self._early.clear()
                return

    @property
    def next_index(self) -> int:
        """The output index of the first token not yet delivered in order."""
        return self._next_index

    def resume_point(self) -> ResumePoint:
        return ResumePoint(request_id=self.request_id, next_index=self._next_index,
                           attempt=self.attempt)

    def fail(self, error: HalfmoonError) -> None:
        self._queue.put_nowait(error)

    def fail_over(self, error: WorkerLost) -> None:
        """`error.worker_id` will not serve the request on (it was lost, or it shed the
        request): its reader places it again, and that worker's late failures are stale."""
        self.placement = None  # until the new placement arrives
        if error.worker_id:  # "": a conductor's move, not a worker's (`redelivery`)
            self.lost_workers.add(error.worker_id)
        self.fail(error)

    def is_stale_placement(self, placed: RequestPlaced) -> bool:
        """A placement of an attempt it has moved on from, or of an earlier delivery of
        its attempt than the placement it follows."""
        current = self.placement
        return placed.attempt < self.attempt or (
            current is not None and current.attempt == placed.attempt
            and 0 < placed.delivery < current.delivery)

    def is_stale_failure(self, worker_id: str) -> bool:
        """A failure from a worker the request no longer depends on: one it failed over
        from, or, once placed, one its placement does not name (a side of an earlier
        attempt, e.g. a decode worker whose reservation was given up for another)."""
        if worker_id in self.lost_workers:
            return True
        placement = self.placement
        return placement is not None and bool(worker_id) and worker_id not in (
            placement.prefill_worker_id, placement.decode_worker_id)

    def lost_worker(self, is_alive: Callable[[str], bool],
                    started_at_s: Callable[[str], float]) -> str | None:
        """The worker this request still depends on that stopped heartbeating, or started
        again since the request was placed on it (what it held is gone: it came back under
        its id within the heartbeat timeout): decode always, prefill until decode streams
        (its KV may still be on the way). (A draining worker is alive.)"""
        placement = self.placement
        if placement is None or self.is_finished:
            return None

        def is_gone(worker_id: str, placed_on_s: float) -> bool:
            return not is_alive(worker_id) or 0 < placed_on_s < started_at_s(worker_id)

        if is_gone(placement.decode_worker_id, placement.decode_started_at_s):
            return placement.decode_worker_id
        if not self.has_decoded and is_gone(placement.prefill_worker_id,
                                            placement.prefill_started_at_s):
            return placement.prefill_worker_id
        return None

    async def next(self, timeout_s: float) -> TokenDelta:
        """The next delta in order; raises the request's error, or `RequestTimeout` when
        nothing arrives for `timeout_s`. Called once per streamed chunk, it yields to the
        loop once per call, so that one stream's backlog does not hold up the others'
        chunks (`wait_for`, which did that by making a task per call, took a tenth of a
        streaming gateway's CPU)."""
        if not self._queue.empty():
            await asyncio.sleep(0)
            item = self._queue.get_nowait()
        else:
            try:
                async with asyncio.timeout(timeout_s):
                    item = await self._queue.get()
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
        self._choices: dict[str, list[str]] = {}  # n > 1: a request's choice streams

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def open_group(self, request_id: str, choice_ids: list[str]) -> list[RequestStream]:
        """One stream per choice; events about the request itself (its placement, its
        failure) reach each of them."""
        if choice_ids != [request_id]:
            self._choices[request_id] = choice_ids
        return [self.open(choice) for choice in choice_ids]

    def close_group(self, request_id: str) -> None:
        for choice in self._choices.pop(request_id, [request_id]):
            self.close(choice)

    def _targets(self, request_id: str) -> list[RequestStream]:
        ids = self._choices.get(request_id, [request_id])
        return [stream for i in ids if (stream := self._streams.get(i)) is not None]

    def dispatch(self, event: GatewayEvent) -> None:
        match event:
            case TokenBatch(worker_id=worker_id, items=items):
                for delta in items:
                    if (stream := self._streams.get(delta.request_id)) is not None:
                        stream.deliver(delta)
                        placement = stream.placement
                        if placement is not None and placement.decode_worker_id == worker_id:
                            stream.has_decoded = True
            case RequestFailed(request_id=request_id, code=code, message=message,
                               retry_after_s=retry_after_s, worker_id=worker_id, param=param,
                               is_final=is_final):
                for stream in self._targets(request_id):
                    if stream.is_stale_failure(worker_id):
                        log.info("request.stale_failure_ignored", request_id=request_id,
                                 worker_id=worker_id, error=message)
                    elif code is ErrorCode.MOVED:
                        stream.fail_over(RequestMoved(message, worker_id=worker_id,
                                                      retry_after_s=retry_after_s))
                    else:
                        stream.fail(error_from_code(code, message, retry_after_s, param,
                                                    is_final=is_final))
            case RequestPlaced(request_id=request_id, attempt=attempt):
                for stream in self._targets(request_id):
                    if stream.is_stale_placement(event):
                        log.info("request.stale_placement_ignored", request_id=request_id,
                                 attempt=attempt, delivery=event.delivery,
                                 current=stream.attempt)
                        continue
                    stream.placement = event
                    stream.has_decoded = False

    def status(self, query: StreamQuery) -> StreamStatus:
        """What this gateway holds of a request a conductor is about to place again: the
        streams of its choices that follow the queried attempt, their placement, and the
        most tokens any of them has had."""
        streams = self._targets(query.request_id)
        following = [stream for stream in streams if stream.attempt == query.attempt]
        return StreamStatus(
            request_id=query.request_id, is_open=bool(streams), is_current=bool(following),
            is_placed=any(stream.placement is not None for stream in following),
            num_streamed=max((stream.next_index for stream in following), default=0))

    def open_streams(self, query: OpenStreamsQuery) -> OpenStreams:
        """Which of a decode worker's requests a client here still waits for, on the
        attempt the worker decodes."""
        return OpenStreams(request_ids=[
            asked.request_id for asked in query.streams
            if any(stream.attempt == asked.attempt for stream in self._targets(asked.request_id))])

    def has_lost(self, is_alive: Callable[[str], bool],
                 started_at_s: Callable[[str], float]) -> bool:
        """Whether a stream's worker was lost (or restarted), as `fail_lost` judges."""
        return any(stream.lost_worker(is_alive, started_at_s) is not None
                   for stream in self._streams.values())

    def fail_lost(self, is_alive: Callable[[str], bool],
                  started_at_s: Callable[[str], float]) -> int:
        """Fail every stream whose worker was lost (or restarted) with `WorkerLost` (its
        reader places it again); return how many."""
        count = 0
        for stream in self._streams.values():
            if (worker_id := stream.lost_worker(is_alive, started_at_s)) is not None:
                stream.fail_over(WorkerLost(f"worker {worker_id} stopped answering",
                                            worker_id=worker_id))
                count += 1
        return count

    def stalled(self, after_s: float, now_s: float | None = None
                ) -> dict[str, list[ResumePoint]]:
        """Placed streams with no new token for `after_s` (and not asked about within
        `after_s`), by their decode worker: where to resume each; marks them asked."""
        points: dict[str, list[ResumePoint]] = defaultdict(list)
        for stream in self._due(after_s, now_s, is_placed=True):
            if (placement := stream.placement) is not None:
                points[placement.decode_worker_id].append(stream.resume_point())
        return points

    def unplaced(self, after_s: float, now_s: float | None = None) -> list[ResumePoint]:
        """Streams with no placement and no new token for `after_s` (and not asked about
        within `after_s`): still queued, or placed with the news lost (`is_unplaced`
        `StreamResume`); marks them asked."""
        return [stream.resume_point() for stream in self._due(after_s, now_s, is_placed=False)]

    def _due(self, after_s: float, now_s: float | None, *, is_placed: bool
             ) -> list[RequestStream]:
        now_s = time.monotonic() if now_s is None else now_s
        due = [stream for stream in self._streams.values()
               if (stream.placement is not None) == is_placed and not stream.is_finished
               and now_s - max(stream.progressed_at, stream.resumed_at) >= after_s]
        for stream in due:
            stream.resumed_at = now_s
        return due

    def fail_all(self, error: HalfmoonError) -> None:
        for stream in self._streams.values():
            stream.fail(error)
