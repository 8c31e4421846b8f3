from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.fake_engine import FakeEngine, fake_completion
from engine.protocol import DecodeRequest, PrefillRequest
from shared.errors import CapacityExhausted, InvalidRequest
from shared.messages import SamplingParams


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = FakeEngine(num_blocks=8, block_size=4, max_batch_size=4)
    await fake.start()
    yield fake
    await fake.close()


def sampling(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=3, **kwargs)  # type: ignore[arg-type]


async def decode_all(engine: FakeEngine, request_id: str, prompt: list[int],
                     params: SamplingParams) -> list[int]:
    result = await engine.prefill(PrefillRequest(request_id, prompt, params))
    engine.release(request_id)
    tokens = [result.first_token_id]
    engine.reserve(request_id, len(prompt) + params.max_tokens)
    engine.join(DecodeRequest(request_id, prompt, result.first_token_id, params))
    while True:
        outputs = [o for o in await engine.next_step() if o.request_id == request_id]
        tokens += [o.token_id for o in outputs]
        if outputs and outputs[-1].finish_reason is not None:
            return tokens


async def test_outputs_are_a_function_of_prompt_and_seed(engine: FakeEngine) -> None:
    tokens = await decode_all(engine, "r1", [1, 2, 3], sampling(6))
    assert tokens == fake_completion([1, 2, 3], 3, 6)
    assert tokens != fake_completion([1, 2, 4], 3, 6)


async def test_prefill_batches_concurrent_requests(engine: FakeEngine) -> None:
    engine.prefill_delay_s = 0.05
    requests = [PrefillRequest(f"r{i}", [i + 1], sampling(2)) for i in range(3)]
    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(engine.prefill(r) for r in requests))
    assert asyncio.get_running_loop().time() - started < 0.09  # one batch, not three


async def test_stop_token_finishes_with_stop(engine: FakeEngine) -> None:
    expected = fake_completion([5, 6], 3, 10)
    params = sampling(10, stop_token_ids=(expected[3],))
    tokens = await decode_all(engine, "r", [5, 6], params)
    assert tokens[-1] == expected[3]
    assert len(tokens) == expected.index(expected[3]) + 1


async def test_blocks_return_to_the_pool_when_requests_end(engine: FakeEngine) -> None:
    await decode_all(engine, "r", [1, 2, 3, 4, 5], sampling(3))
    assert engine.stats().num_free_blocks == 8


async def test_abort_frees_a_reservation(engine: FakeEngine) -> None:
    engine.reserve("r", 16)
    assert engine.stats().num_free_blocks == 4
    assert engine.abort("r")
    assert engine.stats().num_free_blocks == 8
    assert not engine.abort("r")


async def test_reserving_beyond_the_pool_raises_capacity_exhausted(engine: FakeEngine) -> None:
    with pytest.raises(CapacityExhausted, match="need 9 KV blocks, 8 free"):
        engine.reserve("r", 33)


async def test_join_without_reservation_is_refused(engine: FakeEngine) -> None:
    with pytest.raises(InvalidRequest, match="no reserved blocks"):
        engine.join(DecodeRequest("r", [1], 1, sampling(2)))


async def test_a_shared_prefix_is_served_from_the_cache_and_reported() -> None:
    fake = FakeEngine(num_blocks=16, block_size=4)
    await fake.start()
    try:
        first = await fake.prefill(PrefillRequest("a", list(range(1, 11)), sampling(2)))
        fake.release("a")
        assert first.num_cached_tokens == 0
        stored = fake.prefix_cache.drain_kv_events()
        assert [kind for kind, _ in stored] == ["stored", "stored"]  # two full blocks of 4
        second = await fake.prefill(PrefillRequest("b", [*range(1, 9), 42, 43], sampling(2)))
        assert second.num_cached_tokens == 8
        assert second.block_ids[:2] == first.block_ids[:2]
        third = await fake.prefill(PrefillRequest("c", list(range(1, 9)), sampling(2)))
        assert third.num_cached_tokens == 7  # the last prompt token is always computed
    finally:
        await fake.close()


async def test_prefill_cost_counts_only_uncached_tokens() -> None:
    fake = FakeEngine(num_blocks=64, block_size=4, prefill_s_per_token=0.004)
    await fake.start()
    try:
        loop = asyncio.get_running_loop()
        prompt = list(range(1, 41))
        started = loop.time()
        await fake.prefill(PrefillRequest("a", prompt, sampling(2)))
        cold_s = loop.time() - started
        fake.release("a")
        started = loop.time()
        await fake.prefill(PrefillRequest("b", [*prompt, 99], sampling(2)))
        warm_s = loop.time() - started
        assert cold_s >= 0.16  # 40 tokens x 4 ms
        assert warm_s < cold_s / 4  # 1 token computed
        assert fake.stats().prefill_s_per_token == 0.004
    finally:
        await fake.close()


async def test_cached_blocks_are_evicted_with_a_removed_event_when_room_runs_out() -> None:
    fake = FakeEngine(num_blocks=4, block_size=4)
    await fake.start()
    try:
        await fake.prefill(PrefillRequest("a", list(range(1, 9)), sampling(2)))
        fake.release("a")
        assert fake.stats().num_free_blocks == 4  # cached blocks can be handed out
        fake.prefix_cache.drain_kv_events()
        fake.reserve("r", 16)  # all four blocks: the two cached ones are evicted
        assert [kind for kind, _ in fake.prefix_cache.drain_kv_events()] == ["removed", "removed"]
    finally:
        await fake.close()
