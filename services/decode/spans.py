"""Each running request's `decode.stream` span on a decode worker."""

from __future__ import annotations

import time

from opentelemetry.trace import Span, StatusCode

from engine.protocol import TokenOutput
from services.kv_leases import Lease
from shared import tracing


class DecodeSpans:
    """Each running request's `decode.stream` span (join to last token), a child of the
    context current at the join: the prefill side's `kv.transfer` (or `prefill.request` when
    no KV moved), from `KvCommitted`'s headers. The
    reservation and the first step are events on it, not spans of their own: tracing at
    100 % costs per span. Nothing is kept when not tracing."""

    def __init__(self) -> None:
        self._open: dict[str, tuple[Span, bool]] = {}  # request id -> (span, first step seen)

    def start(self, request_id: str, worker_id: str, lease: Lease | None = None) -> None:
        stream = tracing.continued(__name__, "decode.stream", attributes={
            "halfmoon.request_id": request_id, "halfmoon.worker": worker_id})
        if stream is None:
            return
        if lease is not None:  # the reservation, as its lease records it
            waited_ns = int((time.monotonic() - lease.granted_at) * 1e9)
            stream.add_event("reserved", {
                "halfmoon.reserved_blocks": lease.num_blocks,
                "halfmoon.prefill_worker": lease.party,
            }, timestamp=time.time_ns() - waited_ns)
        self._open[request_id] = (stream, False)

    def step(self, output: TokenOutput) -> None:
        entry = self._open.get(output.request_id)
        if entry is None:
            return
        stream, is_first_seen = entry
        if not is_first_seen:
            stream.add_event("first_step")
            self._open[output.request_id] = (stream, True)
        if output.finish_reason is not None:
            stream.set_attributes({"halfmoon.output_tokens": output.index + 1,
                                   "halfmoon.finish_reason": output.finish_reason})
            self.end(output.request_id)

    def end(self, request_id: str, error: str | None = None) -> None:
        entry = self._open.pop(request_id, None)
        if entry is None:
            return
        stream, _ = entry
        if error is not None:
            stream.set_status(StatusCode.ERROR, error)
        stream.end()

    def abort(self, request_id: str) -> None:
        """Told to stop (the client gone, a stop string hit, placed again, no one
        listening): an `aborted` event, no failure of decode's own. Whoever decided it says
        on its own span whether it was one."""
        entry = self._open.get(request_id)
        if entry is not None:
            entry[0].add_event("aborted")
            self.end(request_id)
