from __future__ import annotations

import msgspec
import pytest

from services.conductor.cost_model import (
    SEED_WEIGHTS,
    Slo,
    TransferCost,
    check_slo,
    predicted_tbt_s,
    predicted_ttft_s,
    reuse_benefit_s,
    seed_score,
)
from services.conductor.placement import (
    PendingWork,
    PrefixView,
    SeedInputs,
    pick_prefill,
    prefix_source,
)
from shared.errors import CapacityExhausted
from tests.unit.test_placement import worker


def measured(worker_id: str, *, rate: float = 1000.0, waiting_tokens: int = 0,
             **fields: object) -> object:
    return msgspec.structs.replace(worker(worker_id), prefill_tokens_per_s=rate,
                                   num_waiting_tokens=waiting_tokens, **fields)


def test_seed_weights_sum_to_one() -> None:
    assert sum(SEED_WEIGHTS.values()) == pytest.approx(1.0)


def test_ttft_is_queue_plus_uncached_prompt_over_the_measured_rate() -> None:
    w = measured("a", rate=1000.0, waiting_tokens=500)
    assert predicted_ttft_s(w, 1500, default_tokens_per_s=1.0) == pytest.approx(2.0)  # type: ignore[arg-type]


def test_a_request_waits_behind_the_queued_prompts_of_its_priority_and_more_urgent() -> None:
    w = measured("a", rate=1000.0, waiting_tokens=3000,
                 num_waiting_tokens_by_priority={-1: 500, 0: 1000, 3: 1500})
    for priority, queued in ((None, 3000), (-2, 0), (-1, 500), (0, 1500), (5, 3000)):
        assert predicted_ttft_s(w, 1000, 1.0, priority=priority) == pytest.approx(  # type: ignore[arg-type]
            (queued + 1000) / 1000)
    older = measured("b", rate=1000.0, waiting_tokens=3000)  # says no priorities: all of it
    assert predicted_ttft_s(older, 1000, 1.0, priority=-5) == pytest.approx(4.0)  # type: ignore[arg-type]


def test_unmeasured_worker_uses_the_default_rate() -> None:
    assert predicted_ttft_s(worker("a"), 100, default_tokens_per_s=50.0) == pytest.approx(2.0)


def test_tbt_grows_with_the_batch_it_joins() -> None:
    w = msgspec.structs.replace(worker("d", "decode", running=4), decode_step_s=0.02)
    assert predicted_tbt_s(w) == pytest.approx(0.025)
    assert predicted_tbt_s(worker("d", "decode")) == 0.0  # nothing measured yet


def test_tbt_is_the_fitted_step_at_the_batch_joined_even_on_an_idle_worker() -> None:
    # Its last steps ran 6 sequences in 0.158 s: idle now, one request's steps take the
    # fit's 0.008 + 0.025 s, not the last steps' time (which, doubled, rejected every
    # request while no step ran to measure it again).
    idle = msgspec.structs.replace(worker("d", "decode"), decode_step_s=0.158,
                                   decode_overhead_s=0.008, decode_s_per_sequence=0.025)
    assert predicted_tbt_s(idle) == pytest.approx(0.033)
    busy = msgspec.structs.replace(idle, num_running=5)
    assert predicted_tbt_s(busy) == pytest.approx(0.008 + 0.025 * 6)
    slo = Slo(ttft_s=None, tbt_s=0.1)
    check_slo(0.0, predicted_tbt_s(idle), slo)
    with pytest.raises(CapacityExhausted, match="between tokens"):
        check_slo(0.0, predicted_tbt_s(busy), slo)


def test_seed_score_of_an_ideal_and_a_worst_worker() -> None:
    best = seed_score(worker("a"), load=0.0, max_queue=10, fastest=1.0, decode_zone="")
    worst = seed_score(msgspec.structs.replace(worker("b", waiting=10), zone="far",
                                               compute_score=0.0),
                       load=1.0, max_queue=10, fastest=1.0, decode_zone="",
                       is_model_loaded=False)
    assert best == pytest.approx(1.0)
    assert worst == pytest.approx(0.15 * 0.5)


def test_seed_policy_prefers_the_faster_worker_for_the_same_work() -> None:
    workers = [measured("a", rate=500.0), measured("b", rate=2000.0)]
    seed = SeedInputs(num_prompt_tokens=1000, block_size=16)
    chosen = pick_prefill(workers, (), {}, policy="seed", prefix=PrefixView(62), seed=seed)  # type: ignore[arg-type]
    assert chosen.worker_id == "b"


def test_seed_policy_counts_a_cached_prefix_as_free() -> None:
    workers = [measured("a", rate=1000.0), measured("b", rate=1500.0)]
    prefix = PrefixView(num_blocks=62, cached_blocks={"a": 60})
    seed = SeedInputs(num_prompt_tokens=1000, block_size=16)
    chosen = pick_prefill(workers, (), {}, policy="seed", prefix=prefix, seed=seed)  # type: ignore[arg-type]
    assert chosen.worker_id == "a"


def test_slo_breach_is_a_429_with_retry_after() -> None:
    with pytest.raises(CapacityExhausted, match="predicted TTFT 3000 ms exceeds") as info:
        check_slo(3.0, 0.01, Slo(ttft_s=0.5))
    assert info.value.http_status == 429
    assert info.value.retry_after_s == pytest.approx(2.5)
    with pytest.raises(CapacityExhausted, match="between tokens"):
        check_slo(0.1, 0.2, Slo(ttft_s=0.5, tbt_s=0.05))
    check_slo(0.1, 0.01, Slo(ttft_s=0.5, tbt_s=0.05))  # within both: admitted


def test_fitted_prefill_cost_wins_over_the_rate() -> None:
    w = measured("a", rate=1000.0, waiting_tokens=100, prefill_overhead_s=0.01,
                 prefill_s_per_token=0.002)
    assert predicted_ttft_s(w, 400, default_tokens_per_s=1.0) == pytest.approx(1.01)  # type: ignore[arg-type]


def test_decode_prefers_the_faster_step_among_roomy_workers() -> None:
    from services.conductor.placement import pick_decode

    slow = msgspec.structs.replace(worker("a", "decode", running=2), decode_step_s=0.05)
    fast = msgspec.structs.replace(worker("b", "decode", running=6), decode_step_s=0.01)
    assert pick_decode([slow, fast], (), {}, num_tokens=32).worker_id == "b"


def with_kv(worker_id: str, kv_bytes_per_block: int = 1 << 20) -> object:
    # 1 ms per token: a 16-token block costs 16 ms to compute.
    return measured(worker_id, rate=1000.0, kv_bytes_per_block=kv_bytes_per_block)


def test_reuse_benefit_is_compute_saved_minus_the_move() -> None:
    link = TransferCost(bytes_per_s=1e9, overhead_s=0.002)
    saved = reuse_benefit_s(with_kv("a"), 160, 10 << 20, link, default_tokens_per_s=1.0)  # type: ignore[arg-type]
    assert saved == pytest.approx(0.160 - 0.002 - (10 << 20) / 1e9)


def test_a_longer_prefix_elsewhere_is_fetched_when_moving_it_pays() -> None:
    workers = [with_kv("a"), with_kv("b"), with_kv("c")]
    prefix = PrefixView(num_blocks=10, cached_blocks={"a": 2, "b": 8, "c": 5})
    source = prefix_source(workers[0], workers, prefix, TransferCost(), 1.0)  # type: ignore[arg-type]
    assert source is not None and (source.worker_id, source.num_blocks) == ("b", 8)


def test_no_fetch_over_a_link_slower_than_recomputing() -> None:
    workers = [with_kv("a"), with_kv("b")]
    prefix = PrefixView(num_blocks=10, cached_blocks={"b": 8})
    slow = TransferCost(bytes_per_s=1e6)  # 1 MiB a block at 1 MB/s: ~1 s against 16 ms
    assert prefix_source(workers[0], workers, prefix, slow, 1.0) is None  # type: ignore[arg-type]


def test_no_fetch_when_the_chosen_worker_holds_the_longest_prefix_or_has_no_kv() -> None:
    prefix = PrefixView(num_blocks=10, cached_blocks={"a": 8, "b": 8})
    workers = [with_kv("a"), with_kv("b")]
    assert prefix_source(workers[0], workers, prefix, TransferCost(), 1.0) is None  # type: ignore[arg-type]
    fakes = [with_kv("a", 0), with_kv("b", 0)]  # the fake engine keeps no KV to move
    assert prefix_source(fakes[0], fakes, PrefixView(10, {"b": 8}), TransferCost(), 1.0) is None  # type: ignore[arg-type]


def test_seed_policy_counts_prompt_tokens_sent_since_the_last_heartbeat() -> None:
    workers = [measured("a"), measured("b", waiting_tokens=1000)]
    seed = SeedInputs(num_prompt_tokens=500, block_size=16)
    assert pick_prefill(workers, (), {}, policy="seed", seed=seed).worker_id == "a"  # type: ignore[arg-type]
    burst = {"a": PendingWork(num_requests=4, num_prefill_tokens=2000)}
    assert pick_prefill(workers, (), burst, policy="seed", seed=seed).worker_id == "b"  # type: ignore[arg-type]
