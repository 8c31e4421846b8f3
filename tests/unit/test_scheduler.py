"""The engine scheduler without a model: batching, chunking, waiting, rotation, priorities."""

from __future__ import annotations

from engine.scheduler import Scheduler
from engine.sequence import Sequence
from shared.messages import SamplingParams


def seq(request_id: str, num_tokens: int, arrived_at_s: float = 0.0,
        num_computed: int = 0, priority: int = 0) -> Sequence:
    return Sequence(request_id=request_id, token_ids=list(range(num_tokens)),
                    num_prompt_tokens=num_tokens, sampling=SamplingParams(max_tokens=4),
                    seed=None, arrived_at_s=arrived_at_s, num_computed=num_computed,
                    priority=priority)


def scheduler(**options: float) -> Scheduler:
    return Scheduler(**{"max_batch_tokens": 100, "max_batch_size": 4, "max_wait_s": 0.01,
                        **options})  # type: ignore[arg-type]


def test_prefill_fills_the_token_budget_first_come_first_served() -> None:
    s = scheduler()
    for name, size in (("a", 30), ("b", 50), ("c", 40)):
        s.add_waiting(seq(name, size))
    batch = s.schedule(now_s=0.0)
    assert batch is not None and batch.is_prefill
    assert [x.request_id for x in batch.sequences] == ["a", "b", "c"]
    assert batch.num_new_tokens == [30, 50, 20]  # c is chunked: 20 now, 20 next step


def test_a_prompt_over_the_budget_is_chunked_across_steps() -> None:
    s = scheduler(max_batch_tokens=64)
    long = seq("long", 150)
    s.add_waiting(long)
    chunks = []
    for _ in range(3):
        batch = s.schedule(now_s=0.0)
        assert batch is not None
        chunks.append(batch.num_new_tokens[0])
        long.num_computed += batch.num_new_tokens[0]
    assert chunks == [64, 64, 22]


def test_max_batch_size_caps_a_prefill_batch() -> None:
    s = scheduler(max_batch_tokens=1000)
    for i in range(6):
        s.add_waiting(seq(f"r{i}", 5))
    batch = s.schedule(now_s=0.0)
    assert batch is not None and len(batch.sequences) == 4


def test_decode_runs_until_a_prompt_has_waited_max_wait() -> None:
    s = scheduler()
    s.add_running(seq("d", 10, num_computed=9))
    s.add_waiting(seq("p", 10, arrived_at_s=1.0))
    decode = s.schedule(now_s=1.005)
    assert decode is not None and not decode.is_prefill
    prefill = s.schedule(now_s=1.011)
    assert prefill is not None and prefill.is_prefill


def test_an_idle_engine_prefills_at_once() -> None:
    s = scheduler(max_wait_s=10.0)
    s.add_waiting(seq("p", 5, arrived_at_s=0.0))
    batch = s.schedule(now_s=0.0)
    assert batch is not None and batch.is_prefill


def test_a_full_budget_of_waiting_prompts_preempts_decode() -> None:
    s = scheduler(max_wait_s=10.0)
    s.add_running(seq("d", 10, num_computed=9))
    s.add_waiting(seq("p", 120, arrived_at_s=0.0))
    batch = s.schedule(now_s=0.0)
    assert batch is not None and batch.is_prefill


def test_decode_rotates_when_more_run_than_fit_a_batch() -> None:
    s = scheduler(max_batch_size=2)
    for name in "abc":
        s.add_running(seq(name, 4, num_computed=3))
    first = s.schedule(now_s=0.0)
    second = s.schedule(now_s=0.0)
    assert first is not None and second is not None
    assert [x.request_id for x in first.sequences] == ["a", "b"]
    assert [x.request_id for x in second.sequences] == ["c", "a"]


def test_remove_takes_a_sequence_out_of_either_queue() -> None:
    s = scheduler()
    s.add_waiting(seq("w", 4))
    s.add_running(seq("r", 4, num_computed=3))
    assert s.remove("w") is not None and s.remove("r") is not None
    assert s.remove("w") is None
    assert s.schedule(now_s=0.0) is None


def test_prompts_wait_by_priority_then_arrival() -> None:
    s = scheduler(max_batch_tokens=1000, max_batch_size=8)
    for name, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)):
        s.add_waiting(seq(name, 5, priority=priority))
    batch = s.schedule(now_s=0.0)
    assert batch is not None
    assert [x.request_id for x in batch.sequences] == ["c", "e", "a", "d", "b"]


def test_a_preempted_sequence_waits_first_among_its_priority() -> None:
    s = scheduler(max_batch_tokens=1000, max_batch_size=8)
    urgent, late = seq("urgent", 5, priority=-1), seq("late", 5, priority=1)
    for queued in (urgent, seq("w", 5), late):
        s.add_waiting(queued)
    running = seq("r", 6, num_computed=5)
    s.add_running(running)
    s.preempt(running)
    assert [x.request_id for x in s.waiting] == ["urgent", "r", "w", "late"]


def test_decode_takes_the_most_urgent_and_rotates_within_a_priority() -> None:
    s = scheduler(max_batch_size=2)
    for name, priority in (("a", 0), ("b", 0), ("u", -1), ("c", 0)):
        s.add_running(seq(name, 4, num_computed=3, priority=priority))
    steps = []
    for _ in range(3):
        batch = s.schedule(now_s=0.0)
        assert batch is not None
        steps.append([x.request_id for x in batch.sequences])
    assert steps == [["u", "a"], ["u", "b"], ["u", "c"]]
