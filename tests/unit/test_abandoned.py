"""Which aborts end a request for the conductors, and how many are remembered."""

from __future__ import annotations

from services.conductor.abandoned import Abandoned
from shared.messages import AbortRequest


def test_only_an_abort_that_ends_the_request_is_remembered() -> None:
    abandoned = Abandoned()
    assert not abandoned.note(AbortRequest(request_id="a", reason="prefill failed"))
    assert not abandoned.note(AbortRequest(request_id="b", attempt=2, before_delivery=1))
    assert abandoned.note(AbortRequest(request_id="c", is_ended=True))
    assert "c" in abandoned and "a" not in abandoned and "b" not in abandoned


def test_the_oldest_ended_requests_are_forgotten_first() -> None:
    abandoned = Abandoned(max_requests=2)
    for request_id in ("a", "b", "c"):
        abandoned.note(AbortRequest(request_id=request_id, is_ended=True))
    assert "a" not in abandoned and "b" in abandoned and "c" in abandoned
