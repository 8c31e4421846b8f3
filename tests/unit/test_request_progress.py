"""How many times a request goes on elsewhere: lost workers and hand-backs counted apart."""

from __future__ import annotations

from services.gateway.request_progress import MAX_FAILOVERS, MAX_MOVES, Progress
from shared.errors import RequestMoved, WorkerLost


def test_losses_are_limited_and_hand_backs_do_not_use_them_up() -> None:
    progress = Progress()
    moved = RequestMoved("shed", worker_id="decode-1")
    assert all(progress.may_continue_after(moved) for _ in range(MAX_MOVES))
    lost = WorkerLost("gone", worker_id="decode-2")
    assert all(progress.may_continue_after(lost) for _ in range(MAX_FAILOVERS))
    assert not progress.may_continue_after(lost)
    assert not Progress(num_moved=MAX_MOVES).may_continue_after(moved)
