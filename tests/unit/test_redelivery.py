"""What a conductor does with a request delivered again (pure decisions; the conductor asks
the gateway, then acks, naks, aborts or places)."""

from __future__ import annotations

from services.conductor import holding
from services.conductor.redelivery import HeldHere, Step, next_step
from shared.messages import StreamStatus


def status(**fields: object) -> StreamStatus:
    return StreamStatus(request_id="r", **{"is_open": True, "is_current": True,
                                           **fields})  # type: ignore[arg-type]


def step(answer: StreamStatus | None, num_delivered: int = 2, output_offset: int = 0) -> Step:
    return next_step(answer, num_delivered=num_delivered, output_offset=output_offset)


def test_a_request_the_gateway_has_a_placement_for_is_not_placed_again() -> None:
    assert step(status(is_placed=True)) is Step.DONE
    assert step(status(is_placed=True, num_streamed=40)) is Step.DONE


def test_an_attempt_the_gateway_placed_again_itself_is_left_alone() -> None:
    assert step(status(is_current=False)) is Step.DONE


def test_a_request_no_client_waits_for_is_dropped() -> None:
    assert step(StreamStatus(request_id="r", is_open=False)) is Step.DROP


def test_tokens_from_a_placement_the_gateway_never_heard_of_move_the_rest() -> None:
    assert step(status(num_streamed=40)) is Step.MOVE


def test_a_first_token_alone_is_a_held_requests_prefill_not_a_stream() -> None:
    """Prefill ran and sent the first token, decode refused: the conductor aborted both
    sides and held the request. Placed again (before, that held request was moved: a
    failover spent on every hold)."""
    assert step(status(num_streamed=1)) is Step.PLACE
    assert step(status(num_streamed=2)) is Step.MOVE


def test_a_continuation_is_judged_by_the_tokens_streamed_since_it() -> None:
    """What the client has came from the attempts before it."""
    assert step(status(num_streamed=31), output_offset=30) is Step.PLACE
    assert step(status(num_streamed=32), output_offset=30) is Step.MOVE


def test_a_request_never_placed_nor_streamed_is_placed() -> None:
    """A held request, or one whose first delivery was lost on its way."""
    assert step(status(), num_delivered=5) is Step.PLACE


def test_a_silent_gateway_is_asked_again_until_the_last_delivery() -> None:
    assert step(None) is Step.ASK_LATER
    assert step(None, num_delivered=holding.MAX_DELIVER - 2) is Step.ASK_LATER
    assert step(None, num_delivered=holding.MAX_DELIVER - 1) is Step.PLACE_UNASKED


def test_a_request_held_here_is_known_once_and_the_oldest_forgotten_first() -> None:
    held = HeldHere(max_entries=2)
    for request_id in ("a", "b", "c"):
        held.note(request_id)
    assert not held.take("a")  # forgotten: past the bound
    assert held.take("b")
    assert not held.take("b")  # taken
    assert held.take("c")
