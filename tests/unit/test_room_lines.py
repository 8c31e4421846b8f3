"""The lines requests wait in for room (a worker, KV, a queue place): who gets a turn, and
when a wait ends."""

from __future__ import annotations

import asyncio
import itertools

from services.conductor.room_lines import LATE_TRY_S, RoomLines


def now() -> float:
    return asyncio.get_running_loop().time()


async def test_a_heartbeat_gives_only_the_head_of_its_models_line_a_turn() -> None:
    lines = RoomLines()
    first, second = lines.join("a", "r1"), lines.join("a", "r2")
    other = lines.join("b", "r3")
    lines.wake_head("a")
    assert first.turn.is_set() and not second.turn.is_set() and not other.turn.is_set()
    lines.wake_head("c")  # a model nobody waits for
    assert len(lines) == 3 and lines.has_line("a") and not lines.has_line("c")


async def test_a_head_that_leaves_gives_the_next_a_turn_at_once() -> None:
    lines = RoomLines()
    first, second, third = (lines.join("a", f"r{i}") for i in range(3))
    lines.leave(second)  # not the head: nobody's turn
    assert not third.turn.is_set()
    lines.leave(first)
    assert third.turn.is_set()
    lines.leave(third)
    assert not lines.has_line("a") and len(lines) == 0
    lines.leave(third)  # twice: nothing


async def test_a_waiter_moved_to_another_line_stands_where_its_arrival_places_it() -> None:
    """Behind those of that line that came before it, ahead of those that came after (it
    waited for something else meanwhile, not less)."""
    lines = RoomLines()
    earlier = lines.join("b", "r0", arrived_s=10.0)
    moved, behind = lines.join("a", "r1", arrived_s=11.0), lines.join("a", "r2", arrived_s=12.0)
    later = lines.join("b", "r3", arrived_s=13.0)
    lines.move(moved, "b")
    assert behind.turn.is_set()  # the head left "a": the next one's turn
    assert moved.line == "b" and not moved.turn.is_set()
    lines.leave(earlier)
    assert moved.turn.is_set() and not later.turn.is_set()  # now the head of "b"
    lines.move(moved, "b")  # where it is already: nothing
    assert len(lines) == 3


async def test_waiters_stand_by_priority_then_arrival() -> None:
    """Lower is more urgent: a waiter stands behind its priority and the more urgent, and a
    line counts for a newcomer only with a waiter as urgent as it, or more."""
    lines = RoomLines()
    normal, late = lines.join("a", "n", 0), lines.join("a", "l", 5)
    assert lines.has_line("a", 0) and not lines.has_line("a", -1)
    urgent = lines.join("a", "u", -1)
    second = lines.join("a", "n2", 0)
    lines.wake_head("a")
    assert urgent.turn.is_set() and not normal.turn.is_set()
    lines.leave(urgent)
    assert normal.turn.is_set()
    lines.leave(normal)
    assert second.turn.is_set() and not late.turn.is_set()
    moved = lines.join("b", "m", -1)
    lines.move(moved, "a")  # into its priority's part: ahead of "n2" (and "l")
    lines.wake_head("a")
    assert moved.turn.is_set() and not late.turn.is_set()


async def test_a_waiter_tries_at_each_turn_until_settled() -> None:
    lines = RoomLines()
    waiter = lines.join("a", "r1")
    tries: list[int] = []

    async def try_again() -> bool:
        tries.append(len(tries))
        return len(tries) == 2

    waiting = asyncio.create_task(lines.wait(waiter, lambda: 30.0, try_again))
    for _ in range(2):
        await asyncio.sleep(0.01)
        assert not waiting.done()
        lines.wake_head("a")
    assert await asyncio.wait_for(waiting, 1) is True
    assert tries == [0, 1] and not lines.has_line("a")


async def test_a_waiter_tries_once_more_when_its_time_is_up() -> None:
    lines = RoomLines()
    behind = [lines.join("a", "r0"), lines.join("a", "r1")][1]  # not the head: no turn
    tries: list[float] = []

    async def try_again() -> bool:
        tries.append(now())
        return True  # refused, say: settled all the same

    started = now()
    assert await lines.wait(behind, lambda: started + 0.05 - now(), try_again)
    assert len(tries) == 1 and tries[0] - started >= 0.04


async def test_a_wait_lasts_as_long_as_its_caller_says_after_each_try() -> None:
    """A request's hold depends on what it waits for (a worker, or room on one), which may
    change from one try to the next."""
    lines = RoomLines()
    waiter = lines.join("a", "r0")
    started = now()
    deadline = started  # its time is up: it tries at once
    tries: list[float] = []

    async def try_again() -> bool:
        nonlocal deadline
        tries.append(now())
        deadline = tries[-1] + 0.2  # now waiting for something with a longer hold
        return len(tries) == 2

    assert await lines.wait(waiter, lambda: deadline - now(), try_again)
    assert tries[1] - tries[0] >= 0.18  # not tried again 50 ms after the first


async def test_past_its_time_a_waiter_tries_on_apart_until_settled() -> None:
    """Its caller's clock (a request's age) may run behind the line's: no busy loop then."""
    lines = RoomLines()
    waiter = lines.join("a", "r0")
    tries: list[float] = []

    async def try_again() -> bool:
        tries.append(now())
        return len(tries) == 3

    assert await lines.wait(waiter, lambda: 0.0, try_again) is True
    gaps = [later - earlier for earlier, later in itertools.pairwise(tries)]
    assert len(tries) == 3 and min(gaps) >= 0.9 * LATE_TRY_S


async def test_closing_hands_every_waiter_back_and_a_late_one_too() -> None:
    lines = RoomLines()
    waiters = [lines.join("a", "r1"), lines.join("b", "r2")]

    async def never() -> bool:
        raise AssertionError("no try after the lines close")

    waiting = [asyncio.create_task(lines.wait(w, lambda: 30.0, never)) for w in waiters]
    await asyncio.sleep(0.01)
    lines.close()
    assert await asyncio.gather(*waiting) == [False, False]
    late = lines.join("a", "r3")
    assert await asyncio.wait_for(lines.wait(late, lambda: 30.0, never), 1) is False
    assert len(lines) == 0
