"""Holding a request that cannot be placed yet: pure decisions, tested without NATS.

Some placement failures clear up on their own: no healthy worker of a role (a restart, a
stalled worker that resumes, a healed partition, a NATS node lost, a worker loading the
model: `model_loads`) or no room (`Shortage`: no decode worker with KV room, every prefill
queue full; running requests finish and free both). Such a request is not refused at once,
until its hold is spent; then the error goes to the client (503, or 429). Meanwhile the
conductor keeps its delivery and the request waits in its model's line (`room_lines`),
trying again as the model's workers heartbeat. It goes back to the queue, to come again
soon (`retry_delay_s`), only when its conductor stops, or when a worker was given up in this
delivery (a command unanswered: that worker refuses the rest of the delivery). Anything else
(a refusal by every worker, an SLO the best choice breaks) is answered at once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, get_args

from shared.config import ConductorConfig
from shared.errors import HalfmoonError, ModelLoading, NoHealthyWorker, Shortage
from shared.messages import GenerateRequest, WorkerRole

if TYPE_CHECKING:
    from nats.aio.msg import Msg

WORKER_ROLES: tuple[WorkerRole, ...] = get_args(WorkerRole)
RETRY_S = 0.5  # a held request is delivered again at least this much later
MAX_DELIVER = 8  # deliveries of one request message before JetStream drops it
# A request is held at most this much less than its gateway waits for it
# (`GenerateRequest.wait_s`): its client gets the 429 or 503 that says why, not the
# gateway's 504.
ANSWER_MARGIN_S = 2.0


def wait_of(request: GenerateRequest, config: ConductorConfig) -> float:
    """How long from its creation the request's gateway waits for it: as the request says,
    else (a gateway from before `wait_s`) `request_max_age_s`. Past it, it has expired."""
    return request.wait_s or config.request_max_age_s


def waits_in_line(error: HalfmoonError) -> bool:
    """Whether a request that failed this way waits in its model's line (until its hold)."""
    return isinstance(error, (Shortage, NoHealthyWorker))


def lines_of(model: str) -> tuple[str, ...]:
    """The model's lines, by name: for room (KV, a queue place), which goes to its requests
    first come, first served, so newcomers join it; and one for each missing role, which
    newcomers try past (a short prompt that a decode worker prefills itself needs no prefill
    worker), as do the requests of the other (with both roles gone and one back, those
    that need only that one go). A heartbeat of one of the model's workers wakes each."""
    return model, *(_worker_line(model, role) for role in WORKER_ROLES)


def line_of(model: str, error: HalfmoonError) -> str:
    """The line a request of `model` that failed this way waits in."""
    if isinstance(error, Shortage):
        return model
    role = error.role if isinstance(error, NoHealthyWorker) else ""
    return _worker_line(model, role if role in WORKER_ROLES else WORKER_ROLES[0])


def _worker_line(model: str, role: str) -> str:
    return f"{model} (waiting for a {role} worker)"


def hold_s(error: HalfmoonError, config: ConductorConfig, ttft_slo_s: float | None,
           wait_s: float) -> float:
    """How long, from its creation, a request that failed this way may wait; never longer
    than its gateway waits (`wait_s`), less `ANSWER_MARGIN_S`."""
    if isinstance(error, ModelLoading):
        hold = config.no_worker_hold_s + error.load_s
    elif isinstance(error, NoHealthyWorker):
        hold = config.no_worker_hold_s
    elif isinstance(error, Shortage):
        return shortage_hold_s(config, ttft_slo_s, wait_s)
    else:
        return 0.0
    return min(hold, _answer_by_s(wait_s))


def shortage_hold_s(config: ConductorConfig, ttft_slo_s: float | None, wait_s: float) -> float:
    """How long, from its creation, a request may wait for room (decode KV, a prefill
    queue) in its model's line (`room_lines`): `kv_short_hold_s`, by default as long as its
    gateway waits (`wait_s`), less `ANSWER_MARGIN_S`; never past the TTFT SLO (the answer
    would come too late anyway)."""
    hold = min(_answer_by_s(wait_s), config.kv_short_hold_s
               if config.kv_short_hold_s is not None else wait_s)
    return hold if ttft_slo_s is None else min(hold, ttft_slo_s)


def _answer_by_s(wait_s: float) -> float:
    return max(0.0, wait_s - ANSWER_MARGIN_S)


def retry_delay_s(error: HalfmoonError, config: ConductorConfig, ttft_slo_s: float | None, *,
                  wait_s: float, age_s: float, num_delivered: int) -> float | None:
    """The delay before the request's next delivery, or None: answer `error` now (not a
    failure that clears up, its hold spent, or no delivery left). Soon: the next delivery
    waits in a line if it must."""
    hold = hold_s(error, config, ttft_slo_s, wait_s)
    if hold <= 0 or age_s + RETRY_S > hold or num_delivered >= MAX_DELIVER - 1:
        return None
    return RETRY_S


def age_s(request: GenerateRequest, msg: Msg) -> float:
    """How long the request has been in the cluster, from the later of when its gateway
    made it (the gateway's clock) and when the stream stored it (the NATS server's): a
    gateway whose clock runs behind this host's would otherwise age each of its requests by
    the difference, and past its wait (`wait_of`) every one was dropped as expired."""
    stored_at_s = msg.metadata.timestamp.timestamp()
    return time.time() - max(request.created_at_s, stored_at_s)
