"""The planner's policy, without a cluster: heartbeats and a clock in, moves out."""

from __future__ import annotations

from typing import Any

import pytest

from services.conductor.planner import Move, Planner, PlannerRules, SloRejections, splits
from shared.messages import WorkerHeartbeat, WorkerRole

RULES = PlannerRules(ttft_slo_s=1.0, tbt_slo_s=0.1, high=0.8, low=0.3, hold_s=2.0,
                     cooldown_s=5.0)


def worker(worker_id: str, role: WorkerRole, *, queued_tokens: int = 0, used_blocks: int = 0,
           num_running: int = 0, home: WorkerRole | None = None, **changes: Any
           ) -> WorkerHeartbeat:
    """A worker whose prefill costs 1 ms a token (so 800 queued tokens: 0.8 of a 1 s SLO)
    and whose pool holds 100 blocks."""
    fields: dict[str, Any] = {
        "worker_id": worker_id, "role": role, "model": "m", "host": "h",
        "num_running": num_running, "num_waiting": 0, "max_batch_size": 64,
        "num_free_blocks": 100 - used_blocks, "num_total_blocks": 100, "block_size": 16,
        "heartbeat_interval_s": 0.5, "sent_at_s": 0.0, "num_waiting_tokens": queued_tokens,
        "prefill_s_per_token": 0.001, "decode_step_s": 0.02, "home_role": home or role,
        **changes}
    return WorkerHeartbeat(**fields)


def decide_over(planner: Planner, workers: list[WorkerHeartbeat], seconds: float,
                start_s: float = 100.0) -> list[Move]:
    """Decisions every half second over `seconds`; the first one's moves, if any."""
    for tick in range(int(seconds * 2) + 1):
        if moves := planner.decide(workers, start_s + tick / 2):
            return moves
    return []


def test_pressures_are_shares_of_the_slos() -> None:
    (split,) = splits([worker("p", "prefill", queued_tokens=500),
                       worker("d", "decode", used_blocks=40)], RULES)
    assert split.prefill_pressure == pytest.approx(0.5)
    assert split.decode_pressure == pytest.approx(0.4)  # KV share over step 0.02 / 0.1


def test_a_sustained_prefill_queue_moves_the_idlest_decode_worker_to_prefill() -> None:
    workers = [worker("p", "prefill", queued_tokens=2000),
               worker("d1", "decode", num_running=5), worker("d2", "decode", num_running=1)]
    planner = Planner(RULES)
    assert planner.decide(workers, 100.0) == []
    assert planner.decide(workers, 101.5) == []  # not held for 2 s yet
    (move,) = planner.decide(workers, 102.0)
    assert (move.worker_id, move.from_role, move.to_role) == ("d2", "decode", "prefill")
    assert "prefill pressure 2.00" in move.reason


def test_a_pressure_that_lapses_starts_its_clock_over() -> None:
    busy = [worker("p", "prefill", queued_tokens=2000), worker("d1", "decode"),
            worker("d2", "decode")]
    calm = [worker("p", "prefill", queued_tokens=400), *busy[1:]]
    planner = Planner(RULES)
    planner.decide(busy, 100.0)
    planner.decide(calm, 101.0)
    assert planner.decide(busy, 102.0) == []
    assert planner.decide(busy, 104.0)


def test_no_move_that_would_push_the_giving_role_over_its_mark() -> None:
    workers = [worker("p", "prefill", queued_tokens=2000),
               worker("d1", "decode", used_blocks=50), worker("d2", "decode", used_blocks=50)]
    # Decode at 0.5 now; with one worker fewer its load would be 1.0, over the 0.8 mark.
    assert decide_over(Planner(RULES), workers, 10) == []


def test_never_the_last_worker_of_a_role() -> None:
    workers = [worker("p", "prefill", queued_tokens=5000), worker("d", "decode")]
    assert decide_over(Planner(RULES), workers, 10) == []


def test_running_sequences_are_decode_pressure_reservations_waiting_for_prefill_not() -> None:
    (split,) = splits([worker("p", "prefill"), worker("d", "decode", num_running=48,
                                                      num_waiting=16)], RULES)
    assert split.decode_pressure == pytest.approx(0.75)  # 48 running of a batch of 64


def test_a_full_kv_pool_moves_the_least_queued_prefill_worker_to_decode() -> None:
    workers = [worker("p1", "prefill", queued_tokens=50), worker("p2", "prefill"),
               worker("d", "decode", used_blocks=95)]
    (move,) = decide_over(Planner(RULES), workers, 3)
    assert (move.worker_id, move.to_role) == ("p2", "decode")


def test_a_move_takes_as_many_workers_as_the_pressed_role_needs_and_the_giver_spares() -> None:
    # Prefill at 1.5 of its SLO over 2 workers wants 4 more to reach the marks' middle
    # (0.55); decode, its pools a quarter full and its steps a quarter of its SLO over 4
    # workers, spares 2 (0.25 * 4 / 2 = 0.5) and not 3 (0.25 * 4 / 1 = 1.0, over 0.8).
    decode = [worker(f"d{i}", "decode", num_running=i, used_blocks=25, decode_step_s=0.025)
              for i in range(4)]
    workers = [worker("p1", "prefill", queued_tokens=1500),
               worker("p2", "prefill", queued_tokens=1500), *decode]
    moves = decide_over(Planner(RULES), workers, 3)
    assert [(m.worker_id, m.to_role) for m in moves] == [("d0", "prefill"), ("d1", "prefill")]
    # A pressure just over the mark wants one worker (0.81 * 2 / 0.55: 3 workers).
    workers = [worker("p1", "prefill", queued_tokens=810),
               worker("p2", "prefill", queued_tokens=810), *decode]
    assert len(decide_over(Planner(RULES), workers, 3)) == 1


def test_below_the_high_mark_a_filling_pool_alone_moves_no_worker() -> None:
    # Seven prefill workers at 0.22 of their SLO, one decode worker whose pool is 59 % full
    # and whose steps take 0.2 of theirs (a lone decode worker of long contexts): balancing
    # weighs compute, and decode's is under the low mark. Before, the 0.59 took a prefill
    # worker (0.59 / 2 against 0.22 * 7 / 6), and the planner gave it back seconds later.
    prefill = [worker(f"p{i}", "prefill", queued_tokens=220) for i in range(7)]
    workers = [*prefill, worker("d", "decode", used_blocks=59)]
    assert decide_over(Planner(RULES), workers, 3) == []
    # Its batch 60 % full is compute: a worker moves.
    workers = [*prefill, worker("d", "decode", used_blocks=59, num_running=38)]
    (move,) = decide_over(Planner(RULES), workers, 3)
    assert move.to_role == "decode"
    # So are its steps at 0.6 of their SLO.
    workers = [*prefill, worker("d", "decode", used_blocks=59, decode_step_s=0.06)]
    (move,) = decide_over(Planner(RULES), workers, 3)
    assert move.to_role == "decode"
    # Not once the worker is idle, where it fits its steps (0.02 + 0.02 a sequence): the
    # steps it last ran, at a batch of two, are no load now.
    fitted = {"decode_overhead_s": 0.02, "decode_s_per_sequence": 0.02}
    workers = [*prefill, worker("d", "decode", used_blocks=59, decode_step_s=0.06, **fitted)]
    assert decide_over(Planner(RULES), workers, 3) == []
    workers = [*prefill, worker("d", "decode", used_blocks=59, decode_step_s=0.06,
                                num_running=2, **fitted)]
    (move,) = decide_over(Planner(RULES), workers, 3)
    assert move.to_role == "decode"


def test_below_the_high_mark_workers_move_while_the_role_stays_the_more_pressed() -> None:
    # Prefill at 0.6 over 2, decode at 0.2 over 4: after one move 0.4 against 0.27; after a
    # second 0.3 against 0.4, the other way round: one move.
    decode = [worker(f"d{i}", "decode") for i in range(4)]
    workers = [worker("p1", "prefill", queued_tokens=600),
               worker("p2", "prefill", queued_tokens=600), *decode]
    assert [m.worker_id for m in decide_over(Planner(RULES), workers, 3)] == ["d0"]
    # Under the low mark nothing is pressed, however uneven.
    workers = [worker("p1", "prefill", queued_tokens=300), worker("p2", "prefill"), *decode]
    assert decide_over(Planner(RULES), workers, 3) == []


def test_moves_are_a_cooldown_apart() -> None:
    workers = [worker("p", "prefill", queued_tokens=3000), worker("d1", "decode"),
               worker("d2", "decode"), worker("d3", "decode")]
    planner = Planner(RULES)
    assert decide_over(planner, workers, 3)
    assert decide_over(planner, workers, 4, start_s=102.5) == []  # within 5 s of it
    assert decide_over(planner, workers, 4, start_s=107.5)


RULES_HOME = PlannerRules(ttft_slo_s=1.0, tbt_slo_s=0.1, high=0.8, low=0.3, hold_s=2.0,
                          cooldown_s=5.0, home_after_s=20.0)


def test_a_moved_worker_goes_home_once_both_roles_stayed_calm_for_long() -> None:
    borrowed = worker("d2", "prefill", home="decode")
    workers = [worker("p", "prefill"), borrowed, worker("d1", "decode")]
    planner = Planner(RULES_HOME)
    assert decide_over(planner, workers, 19) == []  # a lull between bursts, not calm yet
    (move,) = decide_over(planner, workers, 2, start_s=119.5)
    assert (move.worker_id, move.to_role, move.reason) == (
        "d2", "decode", "load back under the low mark")
    at_home = [worker("p", "prefill"), worker("d1", "decode"), worker("d2", "decode")]
    assert decide_over(Planner(RULES_HOME), at_home, 30) == []


def test_no_worker_goes_home_where_its_role_would_rise_over_the_low_mark() -> None:
    # Prefill at 0.2 over 2 is calm, but would be at 0.4 without the borrowed worker.
    workers = [worker("p", "prefill", queued_tokens=200),
               worker("d2", "prefill", home="decode", queued_tokens=200),
               worker("d1", "decode")]
    assert decide_over(Planner(RULES_HOME), workers, 30) == []


def test_a_burst_in_the_lull_starts_the_calm_over() -> None:
    planner = Planner(RULES_HOME)
    calm = [worker("p", "prefill"), worker("d2", "prefill", home="decode"),
            worker("d1", "decode")]
    burst = [worker("p", "prefill", queued_tokens=1000), calm[1], calm[2]]  # 0.5: not calm
    assert decide_over(planner, calm, 15) == []
    assert decide_over(planner, burst, 1, start_s=115.5) == []
    assert decide_over(planner, calm, 15, start_s=117.0) == []  # 15 s of calm, not 20
    assert decide_over(planner, calm, 6, start_s=132.5)


def test_a_pressed_role_takes_back_its_own_worker_first() -> None:
    # Decode is pressed; of the two prefill workers the borrowed one goes, though it
    # holds more queued prompt tokens than the other.
    workers = [worker("p", "prefill", queued_tokens=100),
               worker("d3", "prefill", home="decode", queued_tokens=300),
               worker("d1", "decode", num_running=60), worker("d2", "decode", num_running=60)]
    (move,) = decide_over(Planner(RULES), workers, 3)
    assert (move.worker_id, move.from_role, move.to_role) == ("d3", "prefill", "decode")


def test_each_model_is_planned_on_its_own() -> None:
    workers = [worker("a-p", "prefill", queued_tokens=3000), worker("a-d", "decode"),
               worker("b-p", "prefill", model="b"), worker("b-d1", "decode", model="b"),
               worker("b-d2", "decode", model="b")]
    # Model a is busy but has one decode worker only; b's spare decode worker is not a's.
    assert decide_over(Planner(RULES), workers, 10) == []


def test_a_calm_models_worker_is_reassigned_to_the_model_whose_load_dominates() -> None:
    shelf = {"models_on_disk": ["a", "b"]}
    workers = [worker("a-p", "prefill", model="a", queued_tokens=2000),  # 2.0 of its SLO
               worker("a-d", "decode", model="a", used_blocks=90),  # and no decode to spare
               worker("b-p", "prefill", model="b", **shelf),
               worker("b-d1", "decode", model="b", **shelf),
               worker("b-d2", "decode", model="b", num_running=1, **shelf)]
    (move,) = decide_over(Planner(RULES), workers, 3.0)
    assert (move.worker_id, move.from_role, move.to_role, move.to_model) == (
        "b-d1", "decode", "prefill", "a")
    assert move.split.model == "b" and "model a prefill pressure 2.00" in move.reason


def test_no_worker_is_reassigned_without_the_model_on_its_disk() -> None:
    workers = [worker("a-p", "prefill", model="a", queued_tokens=2000),
               worker("a-d", "decode", model="a", used_blocks=90),
               worker("b-p", "prefill", model="b"), worker("b-d1", "decode", model="b"),
               worker("b-d2", "decode", model="b", models_on_disk=["b"])]
    assert decide_over(Planner(RULES), workers, 3.0) == []


def test_a_busy_model_gives_no_worker_away() -> None:
    shelf = {"models_on_disk": ["a", "b"]}
    workers = [worker("a-p", "prefill", model="a", queued_tokens=2000),
               worker("a-d", "decode", model="a", used_blocks=90),
               worker("b-p", "prefill", model="b", queued_tokens=500, **shelf),  # 0.5: not calm
               worker("b-d1", "decode", model="b", **shelf),
               worker("b-d2", "decode", model="b", **shelf)]
    assert decide_over(Planner(RULES), workers, 3.0) == []


def test_a_role_admission_keeps_rejecting_for_counts_as_at_its_slo() -> None:
    # Queues kept short by admission: 600 queued tokens is 0.6 of the TTFT SLO, under the
    # high mark; requests turned away for their TTFT make prefill's pressure 1.0.
    workers = [worker("p", "prefill", queued_tokens=600), worker("d1", "decode"),
               worker("d2", "decode")]
    (split,) = splits(workers, RULES, {("m", "prefill")})
    assert (split.prefill_pressure, split.decode_pressure) == (1.0, pytest.approx(0.2))
    assert decide_over(Planner(RULES), workers, 5) == []
    planner = Planner(RULES)
    (move,) = next(m for tick in range(7)
                if (m := planner.decide(workers, 100 + tick / 2, {("m", "prefill")})))
    assert (move.worker_id, move.to_role) == ("d1", "prefill")
    assert "prefill pressure 1.00" in move.reason


def test_a_model_turned_away_at_its_one_worker_per_role_gets_a_calm_models_worker() -> None:
    shelf = {"models_on_disk": ["a", "b"]}
    workers = [worker("a-p", "prefill", model="a", queued_tokens=600, **shelf),
               worker("a-d", "decode", model="a", **shelf),
               worker("b-p", "prefill", model="b", **shelf),
               worker("b-d1", "decode", model="b", **shelf),
               worker("b-d2", "decode", model="b", **shelf)]
    planner = Planner(RULES)
    (move,) = next(m for tick in range(7)
                if (m := planner.decide(workers, 100 + tick / 2, {("a", "prefill")})))
    assert (move.worker_id, move.to_role, move.to_model) == ("b-d1", "prefill", "a")


def test_slo_rejections_count_within_their_window() -> None:
    rejections = SloRejections()
    rejections.note("a", "prefill", 10.0)
    rejections.note("b", "decode", 12.0)
    assert rejections.within(12.0, 2.0) == {("a", "prefill"), ("b", "decode")}
    assert rejections.within(13.0, 2.0) == {("b", "decode")}


def test_a_decode_worker_past_its_batch_sheds_down_to_the_average_as_far_as_others_have_room(
        ) -> None:
    workers = [worker("p", "prefill"), worker("d1", "decode", num_running=100),
               worker("d2", "decode", num_running=10), worker("d3", "decode")]
    planner = Planner(RULES)
    assert planner.sheds(splits(workers, RULES), 100.0) == []
    assert planner.sheds(splits(workers, RULES), 101.0) == []  # not held for 2 s yet
    (shed,) = planner.sheds(splits(workers, RULES), 102.0)
    assert (shed.worker_id, shed.num_requests) == ("d1", 100 - 37)  # the average: 110 / 3
    assert "runs 100 requests on a batch of 64" in shed.reason
    assert planner.sheds(splits(workers, RULES), 102.5) == []  # its clock starts over
    crowded = [*workers[:2], worker("d2", "decode", num_running=60),
               worker("d3", "decode", num_running=60, num_waiting=2)]
    (shed,) = planner.sheds(splits(crowded, RULES), 110.0) or \
        planner.sheds(splits(crowded, RULES), 112.0)
    assert shed.num_requests == 4 + 2  # the others' batch room, not the average


@pytest.mark.parametrize(("case", "workers"), [
    ("within its batch", [worker("p", "prefill"), worker("d1", "decode", num_running=64),
                          worker("d2", "decode")]),
    ("no other decode worker", [worker("p", "prefill"),
                                worker("d1", "decode", num_running=100)]),
    ("no room elsewhere", [worker("p", "prefill"), worker("d1", "decode", num_running=100),
                           worker("d2", "decode", num_running=64)]),
    ("prefill at its high mark (it recomputes what is shed)",
     [worker("p", "prefill", queued_tokens=900), worker("d1", "decode", num_running=100),
      worker("d2", "decode")]),
    ("the only other one drains", [worker("p", "prefill"),
                                   worker("d1", "decode", num_running=100),
                                   worker("d2", "decode", is_draining=True)]),
])
def test_no_shed(case: str, workers: list[WorkerHeartbeat]) -> None:
    planner = Planner(RULES)
    assert [planner.sheds(splits(workers, RULES), t) for t in (100.0, 103.0)] == [[], []], case
