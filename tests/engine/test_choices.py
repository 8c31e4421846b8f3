"""n > 1 on the engine: one prefill draws every choice's first token; decode forks the
prompt's KV (full blocks shared, the partial one copied) into one sequence per choice; the
choices equal a colocated engine's, and every block comes back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.protocol import DecodeRequest, PrefillRequest, TokenOutput
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import SamplingParams, choice_id

PROMPT = list(range(10, 31))  # 21 tokens: five full blocks of 4 and one partial


async def started(model_dir: Path) -> TorchEngine:
    engine = TorchEngine(EngineOptions(model_dir=model_dir, num_blocks=128, block_size=4))
    await engine.start()
    return engine


async def collect(engine: TorchEngine, ids: set[str]) -> dict[str, list[TokenOutput]]:
    outputs: dict[str, list[TokenOutput]] = {i: [] for i in ids}
    async with asyncio.timeout(30):
        while any(not o or o[-1].finish_reason is None for o in outputs.values()):
            for output in await engine.next_step():
                assert output.error is None, output.error
                outputs[output.request_id].append(output)
    return outputs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_forked_choices_equal_colocated_ones_and_free_every_block(
        llama_dir: Path, temperature: float) -> None:
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=5, ignore_eos=True, n=3)
    ids = {choice_id("r", j, 3) for j in range(3)}
    prefill, decode, colocated = [await started(llama_dir) for _ in range(3)]
    try:
        result = await prefill.prefill(PrefillRequest("r", PROMPT, params))
        assert len(result.forks) == 2
        first_tokens = [result.first_token_id, *(f.token_id for f in result.forks)]
        blocks = decode.reserve("r", len(PROMPT) + 6, num_choices=3,
                                num_prompt_tokens=len(PROMPT))
        per_choice, own = 7, 7 - 5  # ceil(27 / 4); 5 full prompt blocks are shared
        assert len(blocks) == per_choice + 2 * own
        # Stand in for the KV transfer: the prompt's blocks, prefill pool to decode pool.
        assert prefill.kv is not None and decode.kv is not None
        for source, target in zip(result.block_ids, blocks, strict=False):
            decode.kv.data[:, :, target] = prefill.kv.data[:, :, source]
        prefill.release("r")
        decode.join(DecodeRequest("r", PROMPT, first_tokens[0], params,
                                  first_token_ids=first_tokens))
        forked = await collect(decode, ids)
        colocated.generate(PrefillRequest("r", PROMPT, params))
        together = await collect(colocated, ids)
    finally:
        for engine in (prefill, decode, colocated):
            await engine.close()
    tokens = {i: [first_tokens[int(i[-1])]] + [o.token_id for o in forked[i]] for i in ids}
    assert tokens == {i: [o.token_id for o in together[i]] for i in ids}
    distinct = {tuple(t) for t in tokens.values()}
    assert len(distinct) == (1 if temperature == 0 else 3)
    for engine in (decode, colocated):
        assert engine.allocator.num_used == 0
        assert engine._choices == {}


async def test_a_choice_finished_at_prefill_is_not_decoded(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True, n=2)
    engine = await started(llama_dir)
    try:
        engine.reserve("r", len(PROMPT) + 4, num_choices=2, num_prompt_tokens=len(PROMPT))
        engine.join(DecodeRequest("r", PROMPT, 7, params, first_token_ids=[7, 8],
                                  finished_choices=[0]))
        outputs = await collect(engine, {choice_id("r", 1, 2)})
        assert [o.index for o in outputs[choice_id("r", 1, 2)]] == [1, 2, 3]
        await asyncio.sleep(0.05)
        assert engine.allocator.num_used == 0
    finally:
        await engine.close()
