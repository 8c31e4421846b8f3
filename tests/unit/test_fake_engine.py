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
