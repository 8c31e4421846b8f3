"""One request's placement, attempt by attempt, without NATS: which commands each attempt
sends, which sides are kept, and SLO admission."""

from __future__ import annotations

import msgspec
import pytest

from services.conductor import assignment
from services.conductor.assignment import ClusterView, Progress, Rules
from services.conductor.cost_model import Slo
from services.conductor.placement import PendingWork
from shared.errors import HalfmoonError, SloViolation, WorkerUnavailable
from shared.messages import (
    DecodeReservation,
    DispatchReply,
    GenerateRequest,
    PrefillTask,
    SamplingParams,
    WorkerHeartbeat,
)
from tests.unit.test_placement import worker

REQUEST = GenerateRequest(request_id="r", model="m", prompt_token_ids=list(range(40)),
                          sampling=SamplingParams(max_tokens=8), reply_subject="x",
                          created_at_s=0.0)
ACCEPT = DispatchReply(is_accepted=True, worker_id="")
REFUSE = DispatchReply(is_accepted=False, worker_id="", reason="full")


def view(*workers: WorkerHeartbeat) -> ClusterView:
    by_id = {w.worker_id: w for w in workers}
    return ClusterView(prefill=[w for w in workers if w.role == "prefill"],
                       decode=[w for w in workers if w.role == "decode"], pending={},
                       known=lambda worker_id: by_id.get(worker_id or ""))


def attempt(cluster: ClusterView, progress: Progress, *replies: DispatchReply | HalfmoonError
            ) -> assignment.Plan:
    chosen = assignment.plan(REQUEST, cluster, progress, Rules(), prefix=None, turn=0)
    for send, reply in zip(chosen.sends, replies, strict=True):
        progress.record(send, reply)
    return chosen


def sent(chosen: assignment.Plan) -> list[tuple[str, str]]:
    return [(send.role, send.worker.worker_id) for send in chosen.sends]


def test_the_first_attempt_sends_both_sides_at_once() -> None:
    progress = Progress()
    chosen = attempt(view(worker("p1"), worker("d1", "decode")), progress, ACCEPT, ACCEPT)
    assert sent(chosen) == [("prefill", "p1"), ("decode", "d1")]
    assert isinstance(chosen.sends[0].message, PrefillTask)
    reservation = chosen.sends[1].message
    assert isinstance(reservation, DecodeReservation)
    assert reservation.prefill_worker_id == "p1" and not reservation.is_local_prefill
    assert progress.is_complete(chosen) and chosen.path == "disaggregated"


def test_every_command_names_the_delivery_it_was_placed_from() -> None:
    """So a worker can refuse one that arrives after the request was placed again."""
    paired = attempt(view(worker("p1"), worker("d1", "decode")), Progress(delivery=3),
                     ACCEPT, ACCEPT)
    colocated = msgspec.structs.replace(worker("d1", "decode"), local_prefill_max_tokens=64)
    local = attempt(view(colocated), Progress(delivery=2), ACCEPT)
    assert [send.message.delivery for send in paired.sends] == [3, 3]
    assert local.path == "local" and local.sends[0].message.delivery == 2


def test_a_refusing_decode_worker_is_replaced_and_the_accepted_prefill_kept() -> None:
    cluster = view(worker("p1"), worker("d1", "decode"), worker("d2", "decode"))
    progress = Progress()
    first = attempt(cluster, progress, ACCEPT, REFUSE)
    assert not progress.is_complete(first)
    second = attempt(cluster, progress, ACCEPT)
    assert sent(second) == [("decode", "d2")]
    assert progress.is_complete(second) and progress.kept == {"prefill": "p1", "decode": "d2"}


def test_a_new_prefill_worker_is_told_to_the_kept_decode_worker_again() -> None:
    cluster = view(worker("p1"), worker("p2"), worker("d1", "decode"))
    progress = Progress()
    attempt(cluster, progress, REFUSE, ACCEPT)
    second = attempt(cluster, progress, ACCEPT, ACCEPT)
    assert sent(second) == [("prefill", "p2"), ("decode", "d1")]
    reservation = second.sends[1].message
    assert isinstance(reservation, DecodeReservation) and reservation.prefill_worker_id == "p2"


def test_a_kept_decode_worker_that_refuses_the_new_prefill_worker_is_chosen_again() -> None:
    """It never named its blocks to the new prefill worker: kept, the placement would be
    complete with a prefill worker waiting for a `KvTarget` that never comes."""
    cluster = view(worker("p1"), worker("p2"), worker("d1", "decode"), worker("d2", "decode"))
    progress = Progress()
    attempt(cluster, progress, REFUSE, ACCEPT)
    second = attempt(cluster, progress, ACCEPT, REFUSE)
    assert sent(second) == [("prefill", "p2"), ("decode", "d1")]
    assert not progress.is_complete(second) and progress.kept == {"prefill": "p2"}
    assert progress.take_given_up() == ["d1"]  # it holds blocks for p1: told to drop them
    third = attempt(cluster, progress, ACCEPT)
    assert sent(third) == [("decode", "d2")]
    reservation = third.sends[0].message
    assert isinstance(reservation, DecodeReservation) and reservation.prefill_worker_id == "p2"
    assert progress.is_complete(third)


def test_a_worker_that_never_answered_is_given_up_and_a_plain_refusal_is_not() -> None:
    cluster = view(worker("p1"), worker("d1", "decode"), worker("d2", "decode"))
    progress = Progress()
    attempt(cluster, progress, REFUSE, WorkerUnavailable("no answer within 2s"))
    assert progress.take_given_up() == ["d1"]  # it may have accepted late
    assert progress.take_given_up() == []
    assert progress.num_given_up == 1  # d1 refuses the rest of this delivery
    assert progress.excluded == {"p1", "d1"}
    assert progress.num_sent == 2  # refused or unanswered, each was sent


def test_nothing_is_counted_sent_before_a_reply_is_recorded() -> None:
    progress = Progress()
    assignment.plan(REQUEST, view(worker("p1"), worker("d1", "decode")), progress, Rules(),
                    prefix=None, turn=0)
    assert progress.num_attempts == 1 and progress.num_sent == 0


def test_a_kept_side_whose_heartbeats_vanished_is_chosen_again() -> None:
    progress = Progress()
    attempt(view(worker("p1"), worker("d1", "decode")), progress, ACCEPT, REFUSE)
    later = view(worker("p2"), worker("d2", "decode"))  # p1 is gone from the view
    assert sent(attempt(later, progress, ACCEPT, ACCEPT)) == [("prefill", "p2"),
                                                              ("decode", "d2")]


def test_a_short_prompt_goes_to_a_decode_worker_that_prefills_it_itself() -> None:
    local = msgspec.structs.replace(worker("d1", "decode"), local_prefill_max_tokens=64)
    progress = Progress()
    chosen = attempt(view(worker("p1"), local), progress, ACCEPT)
    assert chosen.path == "local" and sent(chosen) == [("decode", "d1")]
    message = chosen.sends[0].message
    assert isinstance(message, DecodeReservation) and message.is_local_prefill
    assert progress.is_complete(chosen)


def test_every_worker_refusing_leaves_no_placement() -> None:
    cluster = view(worker("p1"), worker("d1", "decode"))
    progress = Progress()
    attempt(cluster, progress, REFUSE, REFUSE)
    with pytest.raises(WorkerUnavailable):
        attempt(cluster, progress)


def test_sends_count_as_pending_work_until_refused_or_the_next_heartbeat() -> None:
    chosen = attempt(view(worker("p1"), worker("d1", "decode")), Progress(), ACCEPT, ACCEPT)
    prefill_send, decode_send = chosen.sends
    assert assignment.with_sent(None, prefill_send).num_prefill_tokens == 40
    twice = assignment.with_sent(assignment.with_sent(None, decode_send), decode_send)
    assert twice.num_blocks == 6  # 48 tokens / 16, twice
    once = assignment.without_sent(twice, decode_send)
    assert once == assignment.with_sent(None, decode_send)
    assert once is not None and assignment.without_sent(once, decode_send) is None
    # A heartbeat counted the worker afresh after the send: what is left is not undercut.
    fresh = PendingWork(num_requests=1, num_blocks=2)
    assert assignment.without_sent(fresh, decode_send) is None


def test_admission_rejects_what_cannot_meet_the_ttft_slo() -> None:
    slow = msgspec.structs.replace(worker("p1"), prefill_tokens_per_s=100.0)
    chosen = assignment.plan(REQUEST, view(slow, worker("d1", "decode")), Progress(), Rules(),
                             prefix=None, turn=0)
    assignment.admit(REQUEST, chosen, {}, None, Rules(slo=Slo(ttft_s=1.0)))  # 0.4 s: fine
    with pytest.raises(SloViolation):
        assignment.admit(REQUEST, chosen, {}, None, Rules(slo=Slo(ttft_s=0.1)))


def test_a_prefill_worker_that_measured_nothing_yet_takes_a_request_when_idle() -> None:
    """The default rate (2,000 tokens/s) puts 40 tokens at 20 ms, over a 10 ms SLO: a worker
    that prefilled nothing yet takes the request while idle (its prefill measures it, where
    a guess would refuse every such request for good), not once it has work; a worker that
    measured itself that slow is refused even idle (early rejection)."""
    rules = Rules(slo=Slo(ttft_s=0.01))
    unmeasured = worker("p1")
    assert (unmeasured.prefill_s_per_token, unmeasured.prefill_tokens_per_s) == (0.0, 0.0)
    chosen = assignment.plan(REQUEST, view(unmeasured, worker("d1", "decode")), Progress(),
                             Rules(), prefix=None, turn=0)
    assignment.admit(REQUEST, chosen, {}, None, rules)
    with pytest.raises(SloViolation, match="TTFT"):
        assignment.admit(REQUEST, chosen, {"p1": PendingWork(num_requests=1)}, None, rules)
    measured = msgspec.structs.replace(unmeasured, prefill_s_per_token=0.0005)
    chosen = assignment.plan(REQUEST, view(measured, worker("d1", "decode")), Progress(),
                             Rules(), prefix=None, turn=0)
    with pytest.raises(SloViolation, match="TTFT"):
        assignment.admit(REQUEST, chosen, {}, None, rules)


def test_an_idle_prefill_worker_whose_fit_no_step_renewed_takes_a_request() -> None:
    """A fit measured while every process of the host warmed up (1 s + 0.8 ms a token)
    refused every request on a fresh cluster for good; once no step has renewed it for
    `STALE_FIT_S`, the idle worker takes one, and that step measures it again. Not while it
    has work, nor while its fit is fresh."""
    rules = Rules(slo=Slo(ttft_s=0.01))
    fresh = msgspec.structs.replace(worker("p1"), prefill_overhead_s=1.0,
                                    prefill_s_per_token=0.0008, prefill_fit_age_s=0.5)
    for fit_age_s, is_admitted in ((0.5, False), (assignment.STALE_FIT_S + 0.5, True)):
        idle = msgspec.structs.replace(fresh, prefill_fit_age_s=fit_age_s)
        chosen = assignment.plan(REQUEST, view(idle, worker("d1", "decode")), Progress(),
                                 Rules(), prefix=None, turn=0)
        if is_admitted:
            assignment.admit(REQUEST, chosen, {}, None, rules)
        else:
            with pytest.raises(SloViolation, match="TTFT"):
                assignment.admit(REQUEST, chosen, {}, None, rules)
        with pytest.raises(SloViolation, match="TTFT"):
            assignment.admit(REQUEST, chosen, {"p1": PendingWork(num_requests=1)}, None, rules)


def test_admission_refuses_a_slow_decode_step_only_on_a_worker_that_is_not_idle() -> None:
    """Steps of 50 ms against a 20 ms SLO: an idle worker still takes a request (an estimate
    never measured again while every request was refused would refuse them all for good);
    one with a request running, waiting for its KV or just sent, does not."""
    slow = msgspec.structs.replace(worker("d1", "decode"), decode_step_s=0.05,
                                   decode_overhead_s=0.05)
    rules = Rules(slo=Slo(tbt_s=0.02))
    chosen = assignment.plan(REQUEST, view(worker("p1"), slow), Progress(), Rules(),
                             prefix=None, turn=0)
    assignment.admit(REQUEST, chosen, {}, None, rules)
    with pytest.raises(SloViolation, match="between tokens"):
        assignment.admit(REQUEST, chosen, {"d1": PendingWork(num_requests=1)}, None, rules)
    for busy in (msgspec.structs.replace(slow, num_running=1),
                 msgspec.structs.replace(slow, num_waiting=1)):
        chosen = assignment.plan(REQUEST, view(worker("p1"), busy), Progress(), Rules(),
                                 prefix=None, turn=0)
        with pytest.raises(SloViolation, match="between tokens"):
            assignment.admit(REQUEST, chosen, {}, None, rules)


def test_admission_counts_only_the_queue_ahead_of_a_more_urgent_request() -> None:
    """4,000 prompt tokens queued at priority 0: a request at 0 waits behind them (a TTFT
    over 40 s), one at -1 behind none, as the engine's queue orders them."""
    busy = msgspec.structs.replace(worker("p1"), prefill_tokens_per_s=100.0,
                                   num_waiting_tokens=4000,
                                   num_waiting_tokens_by_priority={0: 4000})
    urgent = msgspec.structs.replace(REQUEST, priority=-1)
    rules = Rules(slo=Slo(ttft_s=1.0))
    chosen = assignment.plan(REQUEST, view(busy, worker("d1", "decode")), Progress(), Rules(),
                             prefix=None, turn=0)
    with pytest.raises(SloViolation):
        assignment.admit(REQUEST, chosen, {}, None, rules)
    assignment.admit(urgent, chosen, {}, None, rules)  # the same pair
