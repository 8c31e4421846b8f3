"""Another decode worker for a request whose KV handoff failed after prefill.

The prefill worker keeps the KV it computed (a `prefill_hold` lease) and asks the conductors'
queue group for a new decode side (`DecodeReplacement`); one conductor places only that side,
the prefill side kept, so the whole KV goes there without computing the prompt again. The
request's gateway learns the new placement, and a public `migrated` event says why. A request
its gateway has ended meanwhile (the commit was refused because the decode worker heard the
end first) gets no new decode side: the refusal, coded `aborted`, tells the prefill worker
to let it go.
"""

from __future__ import annotations

from services.conductor import assignment
from services.conductor.abandoned import Abandoned
from services.conductor.outbox import Outbox
from services.conductor.placer import Placer
from shared.errors import ErrorCode, HalfmoonError, RequestAborted
from shared.heartbeats import WorkerDirectory
from shared.logs import get_logger
from shared.messages import DecodeReplacement, DispatchReply

log = get_logger(__name__)


class DecodeReplacer:
    """Answers the conductors' `DecodeReplacement` requests (one conductor each)."""

    def __init__(self, workers: WorkerDirectory, placer: Placer, outbox: Outbox,
                 abandoned: Abandoned, instance_id: str) -> None:
        self._workers = workers
        self._placer = placer
        self._outbox = outbox
        self._abandoned = abandoned
        self._instance_id = instance_id

    async def replace(self, message: DecodeReplacement) -> DispatchReply:
        """A decode worker for the prefill worker that holds the KV, placed and announced;
        a refusal saying why when none can take it."""
        request = message.request
        if request.request_id in self._abandoned:
            return self._refusal(f"request {request.request_id} was ended by its gateway",
                                 code=ErrorCode.ABORTED)
        if self._workers.get(message.prefill_worker_id) is None:
            # Not kept, the request would be placed anew: its prompt computed twice.
            return self._refusal(f"no decode worker for {request.request_id}: prefill worker "
                                 f"{message.prefill_worker_id} is not among the live workers")
        # The failed worker again only when no other is alive: the bus may have failed, not
        # it (a NATS restart), or its refusal may have passed; a dead one is not alive.
        failed = message.failed_decode_worker_id
        others = [w for w in self._workers.healthy("decode", model=request.model)
                  if w.worker_id != failed]
        progress = assignment.Progress(kept={"prefill": message.prefill_worker_id},
                                       excluded={failed} if others else set())
        try:
            chosen = await self._placer.place(request, progress)
        except HalfmoonError as exc:
            return self._refusal(f"no decode worker for {request.request_id}: {exc.message}",
                                 code=ErrorCode.ABORTED if isinstance(exc, RequestAborted)
                                 else "")
        log.info("placement.decode_replaced", request_id=request.request_id, failed=failed,
                 decode_worker_id=chosen.decode.worker_id, reason=message.reason)
        await self._outbox.tell_placed(request, chosen)  # its prefill side: the one kept
        await self._outbox.tell_migrated(message, chosen)
        return DispatchReply(is_accepted=True, worker_id=self._instance_id)

    def _refusal(self, reason: str, *, code: str = "") -> DispatchReply:
        return DispatchReply(is_accepted=False, worker_id=self._instance_id, reason=reason,
                             code=code)
