"""Commands that arrive after their request was placed again, or ended, refused.

A conductor whose process stands still past the ack wait (SIGSTOP, a paused VM) loses its
delivery of a request: JetStream delivers it to another conductor, which asks the gateway,
aborts what an earlier placement left and places it again. A command the first one sent
just before it stood still, held in its client's buffer or on the wire, can reach a worker
after that abort: it would start a second run of the request for no one, or point the
reservation the new placement made here at the old prefill worker. Likewise a command of
an attempt the gateway has placed again (a continuation after a lost worker) that comes
late. So each command names the JetStream delivery it was placed from
(`PrefillTask.delivery`, `DecodeReservation.delivery`, and the `KvTarget` a reservation
sends), an abort that places a request again names the (attempt, delivery) it is placed
from (`AbortRequest.before_delivery`), and a worker refuses a command from before that.

The other way round too: the abort and the new placement's commands come from different
senders and subscriptions, so a worker may take the new command first. Such an abort does
not reach a placement at or after its mark (a command replacing an earlier delivery's run
here stops that run itself).

An abort by which its gateway ends a request (`AbortRequest.is_ended`: the client has its
answer or is gone) is remembered too: a command that comes after it (a conductor's, sent
before it heard; a commit from a prefill worker the abort has not reached yet) is refused as
aborted, so that nothing runs for no one and a peer does not take the refusal for a fault
to recover from (another decode worker asked for, a `migrated` event for a request that is
gone).
"""

from __future__ import annotations

from shared.messages import AbortRequest, GenerateRequest

# A late command comes within seconds of its abort; the oldest marks are forgotten first.
MAX_REQUESTS = 10_000

Mark = tuple[int, int]  # (attempt, delivery)


class Superseded:
    """Per request, the (attempt, delivery) it was last placed again from, the latest one a
    command taken here was placed from, and whether its gateway ended it."""

    def __init__(self, max_requests: int = MAX_REQUESTS) -> None:
        self._max_requests = max_requests
        self._since: dict[str, Mark] = {}  # insertion-ordered
        self._placed: dict[str, Mark] = {}
        self._ended: dict[str, None] = {}

    def note(self, abort: AbortRequest) -> None:
        if abort.is_ended:
            self._ended[abort.request_id] = None
            self._forget_oldest(self._ended)
        if abort.before_delivery > 0:  # else a plain abort: nothing placed again
            self._raise(self._since, abort.request_id, placed_from(abort))

    def is_ended(self, request_id: str) -> bool:
        """Whether the request's gateway ended it (lately: the oldest are forgotten)."""
        return request_id in self._ended

    def placed(self, request_id: str, attempt: int, delivery: int) -> None:
        """A command placed from `delivery` of `attempt` was taken here."""
        if delivery > 0:
            self._raise(self._placed, request_id, (attempt, delivery))

    def replaces(self, request: GenerateRequest, delivery: int) -> bool:
        """Whether a command for `request` from `delivery` replaces a run taken here from an
        earlier delivery of its attempt (whose abort is still on its way)."""
        return is_replaced(self._placed.get(request.request_id), request.attempt, delivery)

    def reaches(self, abort: AbortRequest) -> bool:
        """Whether the abort reaches what this worker took of the request: a plain one
        always; one that places the request again, unless what was taken here was placed
        from its mark or later (the new placement's command came first)."""
        placed = self._placed.get(abort.request_id)
        return abort.before_delivery <= 0 or placed is None or placed < placed_from(abort)

    def refusal(self, request: GenerateRequest, delivery: int) -> str | None:
        """Why a command for `request` from `delivery` is refused, or None: it is current
        (or names no delivery: a decode side placed again, an older conductor)."""
        since = self._since.get(request.request_id)
        if delivery <= 0 or since is None or (request.attempt, delivery) >= since:
            return None
        return (f"delivery {delivery} of attempt {request.attempt} was placed again (from "
                f"delivery {since[1]} of attempt {since[0]})")

    def _raise(self, marks: dict[str, Mark], request_id: str, mark: Mark) -> None:
        marks[request_id] = max(marks.pop(request_id, mark), mark)
        self._forget_oldest(marks)

    def _forget_oldest(self, entries: dict[str, object]) -> None:
        if len(entries) > self._max_requests:
            del entries[next(iter(entries))]


def placed_from(abort: AbortRequest) -> Mark:
    """Where an abort that places its request again places it from."""
    return abort.attempt, abort.before_delivery


def is_replaced(earlier: Mark | None, attempt: int, delivery: int) -> bool:
    """Whether a command of `delivery` of `attempt` replaces a run taken here from
    `earlier`: a later delivery of the same attempt (its abort still on its way)."""
    return earlier is not None and delivery > 0 and earlier[0] == attempt \
        and 0 < earlier[1] < delivery
