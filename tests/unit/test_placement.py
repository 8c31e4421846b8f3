from __future__ import annotations

import msgspec
import pytest

from services.conductor.placement import (
    PendingWork,
    PrefixView,
    blocks_needed,
    pick_decode,
    pick_prefill,
)
from shared.errors import CapacityExhausted, KvShortage, PrefillQueuesFull, WorkerUnavailable
from shared.messages import WorkerHeartbeat


def worker(worker_id: str, role: str = "prefill", *, running: int = 0, waiting: int = 0,
           free: int = 100) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id, role=role, model="m", host="h", num_running=running,  # type: ignore[arg-type]
        num_waiting=waiting, max_batch_size=8, num_free_blocks=free, num_total_blocks=100,
        block_size=16, heartbeat_interval_s=0.5, sent_at_s=0.0,
    )


def test_prefill_goes_to_the_least_loaded_worker() -> None:
    workers = [worker("a", waiting=3), worker("b", waiting=1), worker("c", running=2)]
    assert pick_prefill(workers, (), {}).worker_id == "b"


def test_ties_go_to_the_lowest_worker_id_so_replicas_agree() -> None:
    workers = [worker("z"), worker("a"), worker("m")]
    assert pick_prefill(workers, (), {}).worker_id == "a"


def test_pending_work_spreads_a_burst_between_heartbeats() -> None:
    workers = [worker("a"), worker("b")]
    assert pick_prefill(workers, (), {"a": PendingWork(num_requests=1)}).worker_id == "b"


def test_excluded_workers_are_skipped() -> None:
    assert pick_prefill([worker("a"), worker("b")], {"a"}, {}).worker_id == "b"


def test_no_prefill_worker_is_unavailable() -> None:
    with pytest.raises(WorkerUnavailable, match="no healthy prefill worker"):
        pick_prefill([worker("a")], {"a"}, {})


def test_a_full_prefill_queue_is_passed_over_counting_what_was_sent_since() -> None:
    full = msgspec.structs.replace(worker("a", waiting=4), max_queue=4)
    filling = msgspec.structs.replace(worker("b", waiting=2), max_queue=4)
    assert pick_prefill([full, filling], (), {}).worker_id == "b"
    with pytest.raises(PrefillQueuesFull, match="queue is full"):
        pick_prefill([full, filling], (), {"b": PendingWork(num_requests=2)})
    unsaid = worker("c", waiting=1000)  # max_queue 0: an older worker that does not say
    assert pick_prefill([full, unsaid], (), {}).worker_id == "c"


def test_decode_needs_room_for_prompt_and_max_tokens() -> None:
    workers = [worker("a", "decode", free=2), worker("b", "decode", free=10, running=5)]
    assert pick_decode(workers, (), {}, num_tokens=100).worker_id == "b"


def test_decode_counts_blocks_promised_since_the_last_heartbeat() -> None:
    workers = [worker("a", "decode", free=10)]
    with pytest.raises(CapacityExhausted, match="KV room"):
        pick_decode(workers, (), {"a": PendingWork(1, 5)}, num_tokens=16 * 6)


def test_decode_without_room_now_is_a_kv_shortage_that_clears_up() -> None:
    with pytest.raises(KvShortage, match="KV room for 1000 tokens now"):
        pick_decode([worker("a", "decode", free=1)], (), {}, num_tokens=1000)


def test_blocks_of_less_urgent_running_requests_are_room_for_a_more_urgent_one() -> None:
    """Its reservation preempts them; blocks of requests as urgent or more are no room."""
    busy = msgspec.structs.replace(worker("a", "decode", free=1),
                                   kv_blocks_by_priority={-1: 40, 0: 30, 2: 20})
    for priority in (2, 0):  # 20 blocks to take at 0: short of 64 + the watermark
        with pytest.raises(KvShortage):
            pick_decode([busy], (), {}, num_tokens=16 * 64, priority=priority)
    assert pick_decode([busy], (), {}, num_tokens=16 * 40, priority=-1).worker_id == "a"
    assert pick_decode([busy], (), {}, num_tokens=16 * 64, priority=-2).worker_id == "a"


def test_a_request_larger_than_any_whole_pool_is_refused_outright() -> None:
    with pytest.raises(CapacityExhausted, match="more KV than any decode worker's whole pool"
                       ) as info:
        pick_decode([worker("a", "decode", free=100)], (), {}, num_tokens=16 * 100)
    assert not isinstance(info.value, KvShortage)


def test_blocks_needed_rounds_up() -> None:
    assert [blocks_needed(n, 16) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]


def test_round_robin_cycles_in_id_order() -> None:
    workers = [worker("b"), worker("a"), worker("c")]
    picks = [pick_prefill(workers, (), {}, policy="round-robin", turn=t).worker_id
             for t in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_cache_aware_prefers_the_worker_holding_the_prefix() -> None:
    workers = [worker("a"), worker("b", waiting=2)]
    prefix = PrefixView(num_blocks=10, cached_blocks={"b": 8})
    assert pick_prefill(workers, (), {}, policy="cache-aware", prefix=prefix).worker_id == "b"


def test_cache_aware_leaves_a_swamped_holder() -> None:
    workers = [worker("a"), worker("b", waiting=40)]
    prefix = PrefixView(num_blocks=10, cached_blocks={"b": 2})
    assert pick_prefill(workers, (), {}, policy="cache-aware", prefix=prefix).worker_id == "a"


def test_cache_aware_without_any_hit_is_least_loaded() -> None:
    workers = [worker("a", waiting=3), worker("b")]
    prefix = PrefixView(num_blocks=4)
    assert pick_prefill(workers, (), {}, policy="cache-aware", prefix=prefix).worker_id == "b"


def test_longest_prefix_follows_the_cache_even_to_a_busy_worker() -> None:
    workers = [worker("a"), worker("b", waiting=40), worker("c", waiting=1)]
    prefix = PrefixView(num_blocks=10, cached_blocks={"b": 2, "c": 2})
    picked = pick_prefill(workers, (), {}, policy="longest-prefix", prefix=prefix)
    assert picked.worker_id == "c"  # the longest prefix, then the less loaded holder


def test_decode_spreads_over_equal_memory_bound_workers() -> None:
    # A memory-bound step costs about the same at batch 1 and batch 10: the emptier worker
    # must win, though its step grows the most, relatively, when a request joins.
    busy = msgspec.structs.replace(worker("a", "decode", running=10), decode_step_s=0.0055)
    idle = msgspec.structs.replace(worker("b", "decode", running=1), decode_step_s=0.0050)
    assert pick_decode([busy, idle], (), {}, num_tokens=32).worker_id == "b"


def test_decode_does_not_favour_a_worker_that_has_not_decoded_yet() -> None:
    # A colocated worker prefilling without pause has no measured step: it is not free.
    stuck = worker("a", "decode", running=30)
    measured = msgspec.structs.replace(worker("b", "decode", running=2), decode_step_s=0.005)
    assert pick_decode([stuck, measured], (), {}, num_tokens=32).worker_id == "b"
