from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from engine.protocol import DecodeRequest, PrefillRequest, TokenOutput
from engine.sim_cost import PROFILES
from engine.sim_engine import SimEngine, SimOptions
from services.worker_parts import build_engine
from shared.config import WorkerConfig
from shared.config_loading import load_config
from shared.errors import ConfigError, EngineFailure, InvalidRequest
from shared.messages import SamplingParams

PROFILE = PROFILES["llama-3-8b-h200"]


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    sim = SimEngine(SimOptions(profile=PROFILE, max_batch_tokens=8192))
    await sim.start()
    yield sim
    await sim.close()


def prompt(length: int, start: int = 1) -> list[int]:
    return [(start + i) % 250 + 1 for i in range(length)]


def sampling(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


async def test_prefill_takes_the_profiles_time(engine: SimEngine) -> None:
    expected_s = PROFILE.prefill_s([(2000, 0)])
    started = time.perf_counter()
    await engine.prefill(PrefillRequest("a", prompt(2000), sampling(4)))
    elapsed_s = time.perf_counter() - started
    assert expected_s * 0.95 <= elapsed_s <= expected_s + 0.05
    assert engine.stats().busy_s == pytest.approx(expected_s)


async def test_time_scale_slows_every_step() -> None:
    sim = SimEngine(SimOptions(profile=PROFILE, time_scale=3.0))
    await sim.start()
    try:
        started = time.perf_counter()
        await sim.prefill(PrefillRequest("a", prompt(1000), sampling(4)))
        elapsed_s = time.perf_counter() - started
    finally:
        await sim.close()
    assert elapsed_s >= 3 * PROFILE.prefill_s([(1000, 0)]) * 0.95
    assert sim.stats().busy_s == pytest.approx(3 * PROFILE.prefill_s([(1000, 0)]))


async def test_layers_are_reported_in_order_across_the_step(engine: SimEngine) -> None:
    seen: list[tuple[int, float]] = []
    started = time.perf_counter()
    await engine.prefill(PrefillRequest(
        "a", prompt(4000), sampling(4),
        on_layer=lambda layer, _blocks: seen.append((layer, time.perf_counter() - started))))
    assert [layer for layer, _ in seen] == list(range(PROFILE.model.num_layers))
    step_s = PROFILE.prefill_s([(4000, 0)])
    assert seen[0][1] < step_s / 4  # the first layer's KV can move long before the last
    assert seen[-1][1] >= step_s * 0.95


async def test_a_cached_prefix_is_not_computed_again(engine: SimEngine) -> None:
    await engine.prefill(PrefillRequest("a", prompt(2000), sampling(4)))
    engine.release("a")
    busy_before = engine.stats().busy_s
    result = await engine.prefill(PrefillRequest("b", prompt(2000) + prompt(16, 7),
                                                 sampling(4)))
    assert result.num_cached_tokens == 2000
    assert engine.stats().busy_s - busy_before == pytest.approx(PROFILE.prefill_s([(16, 2000)]))


async def test_joined_requests_decode_at_the_memory_bound_step(engine: SimEngine) -> None:
    engine.reserve("a", 100)
    engine.join(DecodeRequest("a", prompt(50), first_token_id=97, sampling=sampling(5)))
    outputs: list[TokenOutput] = []
    started = time.perf_counter()
    while not outputs or outputs[-1].finish_reason is None:
        outputs += await engine.next_step()
    elapsed_s = time.perf_counter() - started
    assert [o.index for o in outputs] == [1, 2, 3, 4]
    expected_s = sum(PROFILE.decode_s([50 + n]) for n in range(1, 5))
    assert expected_s * 0.95 <= elapsed_s <= expected_s + 0.05
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


async def test_colocated_prefill_stalls_running_decodes(engine: SimEngine) -> None:
    engine.generate(PrefillRequest("a", prompt(16), sampling(40)))
    stamps: list[float] = []
    outputs: dict[str, list[TokenOutput]] = {"a": [], "b": []}
    while len(outputs["a"]) < 40:
        if len(outputs["a"]) == 10:
            engine.generate(PrefillRequest("b", prompt(4000, 3), sampling(2)))
        for output in await engine.next_step():
            outputs[output.request_id].append(output)
            if output.request_id == "a":
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert max(gaps) >= PROFILE.prefill_s([(4000, 0)]) * 0.95  # a waited for b's prefill
    assert outputs["a"][0].index == 0 and outputs["b"][0].index == 0


async def test_an_aborted_waiting_prompt_costs_nothing(engine: SimEngine) -> None:
    first = asyncio.create_task(engine.prefill(PrefillRequest("a", prompt(3000), sampling(4))))
    await asyncio.sleep(0.005)  # "a" computes
    engine.generate(PrefillRequest("b", prompt(3000, 9), sampling(4)))
    assert engine.abort("b")
    await first
    await asyncio.sleep(0.01)
    assert engine.stats().busy_s == pytest.approx(PROFILE.prefill_s([(3000, 0)]))
    assert engine.stats().num_waiting == 0


async def test_close_fails_waiting_prefills() -> None:
    sim = SimEngine(SimOptions(profile=PROFILE))
    await sim.start()
    running = asyncio.create_task(sim.prefill(PrefillRequest("a", prompt(8000), sampling(4))))
    waiting = asyncio.create_task(sim.prefill(PrefillRequest("b", prompt(8000, 5),
                                                             sampling(4))))
    await asyncio.sleep(0.01)
    await sim.close()
    with pytest.raises(EngineFailure, match="engine closed"):
        await waiting
    running.cancel()
    await asyncio.gather(running, return_exceptions=True)


def test_kv_pool_has_the_profiles_layout_scaled_down() -> None:
    sim = SimEngine(SimOptions(profile=PROFILE, kv_byte_scale=4096))
    layout = sim.kv_layout()
    assert layout.num_layers == 32
    assert layout.layer_block_bytes == 16 * 8 * 128 * 2 // 4096
    assert layout.num_blocks == PROFILE.kv_capacity_tokens() // 16
    with pytest.raises(InvalidRequest, match="KV buffer"):
        sim.use_kv_buffer(memoryview(bytearray(10)))


def test_worker_config_builds_a_sim_engine_or_names_the_profiles() -> None:
    engine = build_engine(load_config(WorkerConfig, flags={
        "engine": "sim", "sim_profile": "llama-3-70b-h200x4"}))
    assert isinstance(engine, SimEngine)
    assert engine.profile.name == "llama-3-70b-h200x4"
    with pytest.raises(ConfigError, match="llama-3-8b-h200"):
        build_engine(load_config(WorkerConfig, flags={"engine": "sim",
                                                      "sim_profile": "gpt-5"}))


async def test_a_full_batch_admits_no_prompt_until_a_sequence_leaves() -> None:
    sim = SimEngine(SimOptions(profile=PROFILE, max_batch_size=1))
    await sim.start()
    try:
        sim.generate(PrefillRequest("a", prompt(16), sampling(5)))
        sim.generate(PrefillRequest("b", prompt(16, 3), sampling(2)))
        order = []
        while len(order) < 7:
            order += [(o.request_id, o.index) for o in await sim.next_step()]
    finally:
        await sim.close()
    assert order == [("a", i) for i in range(5)] + [("b", 0), ("b", 1)]


async def test_loading_the_weights_takes_their_bytes_over_the_load_rate() -> None:
    profile = PROFILES["llama-3-8b-h200"]
    engine = SimEngine(SimOptions(profile=profile, time_scale=0.01,
                                  load_bytes_per_s=profile.weight_bytes / 20.0))
    assert engine.load_s == pytest.approx(20.0)  # simulated seconds
    started = time.perf_counter()
    await engine.start()
    try:
        assert time.perf_counter() - started >= 0.2  # 20 s at a time scale of 0.01
    finally:
        await engine.close()


def test_a_sim_worker_switched_to_another_model_simulates_its_profile() -> None:
    from services.model_shelf import config_for_model, models_on_disk
    from shared.config import WorkerConfig
    from shared.config_loading import load_config

    config = load_config(WorkerConfig, flags={"engine": "sim", "model": "llama-3-8b-h200"})
    assert set(PROFILES) <= set(models_on_disk(config))
    switched = config_for_model(config, "w1", "qwen-2.5-7b-h200", "decode")
    assert (switched.worker_id, switched.role, switched.model) == ("w1", "decode",
                                                                   "qwen-2.5-7b-h200")
    engine = build_engine(switched)
    assert isinstance(engine, SimEngine) and engine.profile.name == "qwen-2.5-7b-h200"
