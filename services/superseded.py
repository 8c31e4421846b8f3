"""Commands that arrive after their request was placed again, refused.

A conductor whose process stands still past the ack wait (SIGSTOP, a paused VM) loses its
delivery of a request: JetStream delivers it to another conductor, which asks the gateway,
aborts what an earlier placement left and places it again. A command the first one sent
just before it stood still, held in its client's buffer or on the wire, can reach a worker
after that abort: it would start a second run of the request for no one, or point the
reservation the new placement made here at the old prefill worker. Likewise a command of
an attempt the gateway has placed again (a continuation after a lost worker) that comes
late. So each command names the JetStream delivery it was placed from
(`PrefillTask.delivery`, `DecodeReservation.delivery`), an abort that places a request
again names the (attempt, delivery) it is placed from (`AbortRequest.before_delivery`), and
a worker refuses a command from before that.
"""

from __future__ import annotations

from shared.messages import AbortRequest, GenerateRequest

# A late command comes within seconds of its abort; the oldest marks are forgotten first.
MAX_REQUESTS = 10_000


class Superseded:
    """Per request, the (attempt, delivery) it was last placed again from."""

    def __init__(self, max_requests: int = MAX_REQUESTS) -> None:
        self._max_requests = max_requests
        self._since: dict[str, tuple[int, int]] = {}  # insertion-ordered

    def note(self, abort: AbortRequest) -> None:
        if abort.before_delivery <= 0:
            return  # a plain abort: nothing placed again
        since = (abort.attempt, abort.before_delivery)
        earlier = self._since.pop(abort.request_id, since)
        self._since[abort.request_id] = max(earlier, since)
        if len(self._since) > self._max_requests:
            del self._since[next(iter(self._since))]

    def refusal(self, request: GenerateRequest, delivery: int) -> str | None:
        """Why a command for `request` from `delivery` is refused, or None: it is current
        (or names no delivery: a decode side placed again, an older conductor)."""
        since = self._since.get(request.request_id)
        if delivery <= 0 or since is None or (request.attempt, delivery) >= since:
            return None
        return (f"delivery {delivery} of attempt {request.attempt} was placed again (from "
                f"delivery {since[1]} of attempt {since[0]})")
