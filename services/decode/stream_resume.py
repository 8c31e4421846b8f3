"""A gateway's `StreamResume`, answered by a decode worker.

A gateway whose stream stalled (e.g. across a NATS restart) names, for each stream, the
index from which it has no tokens: those sent since go out again (`sent_tokens`; the gateway
drops duplicates). A stream this worker does not hold at all is handed back
(`RequestMoved`), so the gateway places the rest elsewhere instead of waiting on it to its
timeout: its run here was stopped (by an abort meant for another placement of it), or never
came. Asked among every decode worker (`is_unplaced`: the gateway never heard where the
request went), a worker answers only for the streams it holds, on the attempt the gateway
follows: where each runs (`RequestPlaced`), then its tokens again.
"""

from __future__ import annotations

from nats.aio.client import Client as NatsClient
from structlog.typing import FilteringBoundLogger

from services.decode.held_requests import HeldRequests
from services.decode.sent_tokens import SentTokens
from shared.errors import ErrorCode
from shared.heartbeats import WorkerDirectory
from shared.messages import RequestFailed, RequestPlaced, ResumePoint, StreamResume, request_of
from shared.nats_client import encode
from shared.token_batches import encoded_batches


class StreamResumes:
    """Answers `StreamResume`s from what the worker holds and what it sent."""

    def __init__(self, nc: NatsClient, worker_id: str, started_at_s: float,
                 held: HeldRequests, sent: SentTokens, prefills: WorkerDirectory,
                 log: FilteringBoundLogger) -> None:
        self._nc = nc
        self._worker_id = worker_id
        self._started_at_s = started_at_s
        self._held = held
        self._sent = sent
        self._prefills = prefills
        self._log = log

    async def answer(self, message: StreamResume) -> None:
        if message.is_unplaced:
            await self._announce(message)
            return
        await self._resend(message.reply_subject, message.points)
        for point in message.points:
            if not self._holds(point.request_id):
                self._log.warning("request.not_held", request_id=point.request_id)
                await self._nc.publish(message.reply_subject, encode(RequestFailed(
                    request_id=point.request_id, code=ErrorCode.MOVED,
                    worker_id=self._worker_id,
                    message=f"decode worker {self._worker_id} does not hold the request")))

    async def _resend(self, reply_subject: str, points: list[ResumePoint]) -> None:
        items = [delta for point in points if (delta := self._sent.resend(point)) is not None]
        if items:
            for batch in encoded_batches(self._worker_id, items, self._nc.max_payload):
                await self._nc.publish(reply_subject, batch)
            self._log.info("decode.resent", num_requests=len(items),
                           num_tokens=sum(len(d.token_ids) for d in items))

    async def _announce(self, message: StreamResume) -> None:
        """The streams of `message` held here, on the attempt the gateway follows: where
        they run (`RequestPlaced`), then their tokens again."""
        held = [point for point in message.points
                if self._held_attempt(point.request_id) == point.attempt]
        for point in {request_of(point.request_id): point for point in held}.values():
            await self._nc.publish(message.reply_subject, encode(self._placement(point)))
        if held:
            self._log.info("decode.announced", num_streams=len(held))
        await self._resend(message.reply_subject, held)

    def _held_attempt(self, stream_id: str) -> int | None:
        """Which attempt of a stream this worker holds (or finished lately), if any."""
        held = self._held.attempt(request_of(stream_id))
        if held is None and (sent := self._sent.request(stream_id)) is not None:
            held = sent.attempt
        return held

    def _placement(self, point: ResumePoint) -> RequestPlaced:
        """Where a stream held here runs: on this worker, and on the prefill worker its KV
        still waits for (else this one: nothing of the request is elsewhere)."""
        request_id, started_at_s = request_of(point.request_id), self._started_at_s
        prefill_id = self._held.prefill_worker_of(request_id) or self._worker_id
        return RequestPlaced(
            request_id=request_id, prefill_worker_id=prefill_id,
            decode_worker_id=self._worker_id, decode_started_at_s=started_at_s,
            prefill_started_at_s=started_at_s if prefill_id == self._worker_id
            else self._prefills.started_at_s(prefill_id),
            attempt=point.attempt)

    def _holds(self, stream_id: str) -> bool:
        """Whether this worker holds a stream: reserved, prefilling, decoding, or finished
        lately (its tokens kept to send again)."""
        return self._sent.has(stream_id) or self._held.holds(stream_id)
