"""KV that grows as sequences do, and preemption by recompute when the pool runs out: no
request is failed for lack of blocks, and none loses or repeats a token."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.protocol import DecodeRequest, PrefillRequest, TokenOutput
from engine.torch_engine import TorchEngine
from shared.errors import CapacityExhausted, InvalidRequest
from shared.messages import SamplingParams
from tests.engine.test_against_transformers import GREEDY, collect, generate, start_engine

PROMPTS = [[(11 * i + 5 * j) % 290 + 5 for j in range(8 + i % 13)] for i in range(32)]


async def test_requests_four_times_the_pool_all_complete_as_if_each_ran_alone(
        llama_dir: Path) -> None:
    roomy = await start_engine(llama_dir, num_blocks=1024)
    try:
        alone = [(await generate(roomy, [prompt], f"alone{i}-"))[0]
                 for i, prompt in enumerate(PROMPTS)]
    finally:
        await roomy.close()
    needed = sum(len(p) + GREEDY.max_tokens for p in PROMPTS)
    num_blocks = needed // 4 // 4  # a quarter of the tokens, in blocks of 4
    tight = await start_engine(llama_dir, num_blocks=num_blocks, max_batch_size=32)
    try:
        assert await generate(tight, PROMPTS) == alone
        stats = tight.stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_blocks == stats.num_total_blocks == num_blocks
    finally:
        await tight.close()


async def finished(engine: TorchEngine, request_ids: set[str]) -> dict[str, TokenOutput]:
    """Each request's last output, once all have finished (none may fail)."""
    outputs: dict[str, TokenOutput] = {}
    async with asyncio.timeout(30):
        while len(outputs) < len(request_ids):
            for out in await engine.next_step():
                assert out.error is None, out.error
                if out.finish_reason is not None:
                    outputs[out.request_id] = out
    return outputs


async def test_the_context_is_capped_at_the_pool_and_a_request_past_it_ends_there(
        llama_dir: Path) -> None:
    """A sequence longer than the whole pool could only preempt itself and wait forever to
    be computed again (a decode worker's stream stalled so): the engine's context is the
    pool's, and a request asking more ends at it ("length"), as at the model's context."""
    engine = await start_engine(llama_dir, num_blocks=8)  # 32 tokens
    try:
        assert engine.max_model_len == engine.stats().max_model_len == 32
        engine.generate(PrefillRequest("big", PROMPTS[0], GREEDY))  # 8 + 32 tokens
        engine.generate(PrefillRequest("fits", PROMPTS[0], SamplingParams(
            max_tokens=20, temperature=0.0, ignore_eos=True)))
        outputs = await finished(engine, {"big", "fits"})
        assert outputs["big"].finish_reason == "length" and outputs["big"].index == 32 - 8 - 1
        assert outputs["fits"].finish_reason == "length" and outputs["fits"].index == 19
        with pytest.raises(InvalidRequest):
            engine.generate(PrefillRequest("past", list(range(5, 37)), GREEDY))
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        await engine.close()


async def test_a_decode_worker_ends_a_request_at_its_pool_instead_of_stalling(
        llama_dir: Path) -> None:
    """Disaggregated: a request whose prompt and output outgrow the decode worker's whole
    pool (its prompt's KV handed in, then grown) ends with "length" at the pool; before,
    it preempted itself there and its stream made no progress again."""
    prefill = await start_engine(llama_dir, num_blocks=64)
    decode = await start_engine(llama_dir, num_blocks=8)  # 32 tokens
    try:
        prompt = PROMPTS[12]  # 8 + 12 tokens
        result = await prefill.prefill(PrefillRequest("r", prompt, GREEDY))
        blocks = decode.reserve("r", len(prompt) + GREEDY.max_tokens,
                                num_prompt_tokens=len(prompt))
        source = prefill.kv.data[:, :, result.block_ids]  # type: ignore[union-attr]
        decode.kv.data[:, :, blocks[:len(result.block_ids)]] = source  # type: ignore[union-attr]
        prefill.release("r")
        decode.join(DecodeRequest("r", prompt, result.first_token_id, GREEDY))
        last = (await finished(decode, {"r"}))["r"]
        assert last.finish_reason == "length" and last.index == 32 - len(prompt) - 1
        assert decode.stats().num_free_blocks == 8
    finally:
        await prefill.close()
        await decode.close()


@pytest.mark.parametrize("max_tokens", [1, 200])
async def test_a_decode_reservation_takes_the_prompt_and_a_block_of_headroom(
        llama_dir: Path, max_tokens: int) -> None:
    engine = await start_engine(llama_dir, num_blocks=64)  # blocks of 4
    try:
        blocks = engine.reserve("r", 17 + max_tokens, num_prompt_tokens=17)
        assert len(blocks) == (5 if max_tokens == 1 else 6)  # 18 tokens; or 17 + 4
        engine.abort("r")
        assert (await collect(engine, set())) == {}
    finally:
        await engine.close()


async def test_a_decode_worker_grows_its_reservations_and_preempts_when_short(
        llama_dir: Path) -> None:
    """Disaggregated: decode holds each prompt's KV (copied in, as a handoff lands it) and a
    block of headroom, then grows; its pool holds every reservation but not half of what
    the requests grow to."""
    roomy = await start_engine(llama_dir, num_blocks=1024)
    try:
        alone = [(await generate(roomy, [prompt], f"alone{i}-"))[0]
                 for i, prompt in enumerate(PROMPTS)]
        results = [await roomy.prefill(PrefillRequest(f"p{i}", prompt, GREEDY))
                   for i, prompt in enumerate(PROMPTS)]
        reserved = sum(-(-(len(p) + 4) // 4) for p in PROMPTS)
        decode = await start_engine(llama_dir, num_blocks=reserved + 4, max_batch_size=32)
        try:
            for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
                targets = decode.reserve(f"d{i}", len(prompt) + GREEDY.max_tokens,
                                         num_prompt_tokens=len(prompt))
                source = roomy.kv.data[:, :, result.block_ids]  # type: ignore[union-attr]
                decode.kv.data[:, :, targets[:len(result.block_ids)]] = source  # type: ignore[union-attr]
                roomy.release(f"p{i}")
            for i, (prompt, result) in enumerate(zip(PROMPTS, results, strict=True)):
                decode.join(DecodeRequest(f"d{i}", prompt, result.first_token_id, GREEDY))
            rest = await collect(decode, {f"d{i}" for i in range(len(PROMPTS))})
            outputs = [[results[i].first_token_id, *rest[f"d{i}"]] for i in range(len(PROMPTS))]
            assert outputs == alone
            stats = decode.stats()
            assert stats.num_preemptions > 0
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            await decode.close()
    finally:
        await roomy.close()


async def test_an_urgent_prompt_takes_the_blocks_of_less_urgent_running_requests(
        llama_dir: Path) -> None:
    """Eight requests run in a pool that holds all they will grow to, until too little is
    left for a long prompt beside them; two such prompts then come, more urgent: they take
    blocks from the running ones (preempted by recompute) and finish first, where at one
    priority they would wait for one of those to end. Every output is the one it gets
    alone."""
    long = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    normal = PROMPTS[:8]
    urgent = [[(7 * j + i) % 290 + 5 for j in range(100)] for i in range(2)]
    alone = await outputs_alone(llama_dir, {
        **{f"n{i}": (prompt, long) for i, prompt in enumerate(normal)},
        **{f"u{i}": (prompt, short) for i, prompt in enumerate(urgent)}})
    engine = await engine_fitting(llama_dir, normal, long)
    try:
        for i, prompt in enumerate(normal):
            engine.generate(PrefillRequest(f"n{i}", prompt, long))
        outputs: dict[str, list[int]] = {name: [] for name in alone}
        order: list[str] = []
        async with asyncio.timeout(60):
            # A 100-token prompt needs 26 blocks, and one spare per running request.
            while engine.stats().num_free_blocks >= 26 + len(normal):
                for out in await engine.next_step():
                    outputs[out.request_id].append(out.token_id)
            assert all(len(outputs[f"n{i}"]) < 90 for i in range(len(normal)))
            for i, prompt in enumerate(urgent):
                engine.generate(PrefillRequest(f"u{i}", prompt, short, priority=-1))
            while len(order) < len(alone):
                for out in await engine.next_step():
                    assert out.error is None, out.error
                    outputs[out.request_id].append(out.token_id)
                    if out.finish_reason is not None:
                        order.append(out.request_id)
        assert sorted(order[:2]) == ["u0", "u1"]
        assert outputs == alone
        assert engine.stats().num_preemptions > 0
    finally:
        await engine.close()


async def outputs_alone(llama_dir: Path, runs: dict[str, tuple[list[int], SamplingParams]]
                        ) -> dict[str, list[int]]:
    """Each run's output on an engine with room for all of them, one at a time."""
    roomy = await start_engine(llama_dir, num_blocks=1024)
    try:
        return {name: await first_run(roomy, prompt, sampling)
                for name, (prompt, sampling) in runs.items()}
    finally:
        await roomy.close()


async def engine_fitting(llama_dir: Path, prompts: list[list[int]], sampling: SamplingParams
                         ) -> TorchEngine:
    """An engine whose pool (blocks of 4) holds just what `prompts` grow to."""
    num_blocks = sum(-(-(len(p) + sampling.max_tokens) // 4) for p in prompts)
    return await start_engine(llama_dir, num_blocks=num_blocks, max_batch_size=32)


async def first_run(engine: TorchEngine, prompt: list[int], sampling: SamplingParams
                    ) -> list[int]:
    engine.generate(PrefillRequest("alone", prompt, sampling))
    return (await collect(engine, {"alone"}))["alone"]


async def test_a_reservation_more_urgent_than_running_requests_takes_their_blocks(
        llama_dir: Path) -> None:
    """A decode worker's pool full of running requests: a reservation at their priority is
    refused and preempts none; a more urgent one gets its blocks from them (preempted by
    recompute), and they all finish as they would alone."""
    long = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    normal = PROMPTS[:6]
    alone = await outputs_alone(llama_dir,
                                {f"n{i}": (prompt, long) for i, prompt in enumerate(normal)})
    engine = await engine_fitting(llama_dir, normal, long)
    try:
        for i, prompt in enumerate(normal):
            engine.generate(PrefillRequest(f"n{i}", prompt, long, priority=1))
        outputs: dict[str, list[int]] = {name: [] for name in alone}
        async with asyncio.timeout(60):
            while engine.stats().num_free_blocks >= 25:  # a 100-token prompt's, and more
                for out in await engine.next_step():
                    outputs[out.request_id].append(out.token_id)
            assert engine.stats().blocks_by_priority.keys() == {1}
            with pytest.raises(CapacityExhausted):
                await engine.reserve_over("same", 100, priority=1, num_prompt_tokens=100)
            assert engine.stats().num_preemptions == 0
            blocks = await engine.reserve_over("urgent", 100, priority=0, num_prompt_tokens=100)
            assert len(blocks) >= 25 and engine.stats().num_preemptions > 0
            assert engine.abort("urgent")  # its blocks back: the preempted ones come back
            while any(len(outputs[name]) < long.max_tokens for name in alone):
                for out in await engine.next_step():
                    assert out.error is None, out.error
                    outputs[out.request_id].append(out.token_id)
        assert outputs == alone
    finally:
        await engine.close()


async def test_a_reservation_given_up_while_the_engine_thread_takes_it_frees_its_blocks(
        llama_dir: Path) -> None:
    """Its caller gone (an abort, a timeout) before the engine thread handed the blocks
    over: they go back to the pool, not to no one."""
    engine = await start_engine(llama_dir, num_blocks=64)
    try:
        taking = asyncio.create_task(
            engine.reserve_over("gone", 40, priority=0, num_prompt_tokens=40))
        await asyncio.sleep(0)  # submitted to the engine thread, waiting for its blocks
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking
        # Commands run in order and their results come back in order: once this one is
        # handed over, the given-up one was too.
        after = await engine.reserve_over("after", 40, priority=0, num_prompt_tokens=40)
        assert engine.allocator.num_used == len(after)
        assert not engine.abort("gone") and engine.abort("after")
        assert engine.allocator.num_used == 0
    finally:
        await engine.close()
