"""Which late commands a worker refuses once their request was placed again (pure)."""

from __future__ import annotations

from services.superseded import Superseded, is_replaced
from shared.messages import AbortRequest, GenerateRequest, SamplingParams


def request(request_id: str = "r1", attempt: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, model="m", prompt_token_ids=[1, 2],
                           sampling=SamplingParams(max_tokens=4), reply_subject="_INBOX.x",
                           created_at_s=0.0, attempt=attempt)


def placed_again(request_id: str = "r1", attempt: int = 0,
                 before_delivery: int = 2) -> AbortRequest:
    return AbortRequest(request_id=request_id, attempt=attempt, before_delivery=before_delivery)


def test_a_command_from_an_earlier_delivery_is_refused_and_a_current_one_is_not() -> None:
    superseded = Superseded()
    superseded.note(placed_again(before_delivery=3))
    assert superseded.refusal(request(), 2) == \
        "delivery 2 of attempt 0 was placed again (from delivery 3 of attempt 0)"
    assert superseded.refusal(request(), 3) is None
    assert superseded.refusal(request(), 4) is None
    assert superseded.refusal(request(attempt=1), 1) is None  # a later attempt
    assert superseded.refusal(request("r2"), 1) is None  # another request


def test_a_command_naming_no_delivery_is_never_refused() -> None:
    """A decode side placed again after a failed handoff, or an older conductor's."""
    superseded = Superseded()
    superseded.note(placed_again(before_delivery=3))
    assert superseded.refusal(request(), 0) is None


def test_a_plain_abort_refuses_nothing_later() -> None:
    superseded = Superseded()
    superseded.note(AbortRequest(request_id="r1", reason="client gone"))
    assert superseded.refusal(request(), 1) is None


def test_an_attempt_placed_again_refuses_every_delivery_of_the_ones_before() -> None:
    superseded = Superseded()
    superseded.note(placed_again(attempt=1, before_delivery=1))  # the gateway's
    assert superseded.refusal(request(), 7) is not None
    assert superseded.refusal(request(attempt=1), 1) is None


def test_an_older_abort_arriving_late_does_not_lower_the_mark() -> None:
    superseded = Superseded()
    superseded.note(placed_again(before_delivery=4))
    superseded.note(placed_again(before_delivery=2))
    assert superseded.refusal(request(), 3) is not None


def test_the_oldest_marks_are_forgotten_past_the_bound() -> None:
    superseded = Superseded(max_requests=2)
    for request_id in ("r1", "r2", "r3"):
        superseded.note(placed_again(request_id))
    assert superseded.refusal(request("r1"), 1) is None
    assert superseded.refusal(request("r2"), 1) is not None
    assert superseded.refusal(request("r3"), 1) is not None


def test_an_abort_that_places_again_does_not_reach_what_its_placement_put_here_first() -> None:
    """The new placement's command was taken before the abort that places it again (they
    come from different senders): the abort passes it over."""
    superseded = Superseded()
    superseded.placed("r1", 0, 2)
    assert not superseded.reaches(placed_again(before_delivery=2))
    assert superseded.reaches(placed_again(before_delivery=3))
    assert superseded.reaches(AbortRequest(request_id="r1", reason="client gone"))
    assert superseded.reaches(placed_again("r2"))  # nothing taken here


def test_a_run_placed_from_no_delivery_is_reached_by_every_abort() -> None:
    superseded = Superseded()
    superseded.placed("r1", 0, 0)
    assert superseded.reaches(placed_again(before_delivery=2))


def test_a_later_delivery_of_the_same_attempt_replaces_a_run_taken_here() -> None:
    assert is_replaced((0, 1), 0, 2)
    assert not is_replaced((0, 2), 0, 2)  # the same delivery again
    assert not is_replaced((0, 1), 1, 2)  # another attempt: the attempt rules apply
    assert not is_replaced((0, 0), 0, 2)  # a run naming no delivery
    assert not is_replaced((0, 1), 0, 0)
    assert not is_replaced(None, 0, 2)


def test_a_request_its_gateway_ended_is_remembered_and_the_oldest_forgotten() -> None:
    superseded = Superseded(max_requests=2)
    superseded.note(AbortRequest(request_id="r0", reason="placed elsewhere"))
    assert not superseded.is_ended("r0")  # a plain abort ends nothing
    for request_id in ("r1", "r2", "r3"):
        superseded.note(AbortRequest(request_id=request_id, reason="gateway", is_ended=True))
    assert [superseded.is_ended(r) for r in ("r1", "r2", "r3")] == [False, True, True]
