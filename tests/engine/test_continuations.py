"""A continuation (a request placed again after a worker was lost: its prompt followed by
the k tokens already streamed, `output_offset = k`, `max_tokens` less k) draws the same
tokens the request would have drawn uninterrupted, whatever its sampling controls: seeds
address the draw by output position, penalties, `min_tokens` and bad words count the earlier
output, and a grammar closes a JSON text on the request's whole budget, not the rest of it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from engine.builtin_model import write_builtin_model
from engine.protocol import PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from shared.messages import GrammarSpec, SamplingParams

PROMPT = [5, 60, 61, 62, 9, 70, 71, 72, 73, 20, 33]
MAX_TOKENS = 40
INTEGER = GrammarSpec(kind="json_schema", source='{"type": "object", "properties": '
                      '{"n": {"type": "integer"}}, "required": ["n"]}')
SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True),
    "controls": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=4, min_tokens=30,
                               presence_penalty=0.8, frequency_penalty=0.6,
                               repetition_penalty=1.3, bad_words=((61, 62),)),
    # A random model writes digits on and on: the closer decides where the number ends.
    "json": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, grammar=INTEGER),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("model") / "tiny")


async def generated(engine: TorchEngine, request: PrefillRequest) -> list[int]:
    engine.generate(request)
    tokens: list[int] = []
    async with asyncio.timeout(60):
        while True:
            for output in await engine.next_step():
                assert output.error is None, output.error
                tokens.append(output.token_id)
                if output.finish_reason is not None:
                    return tokens


@pytest.mark.parametrize("name", list(SAMPLINGS))
async def test_a_continuation_draws_what_the_request_would_have_drawn(
        tiny_dir: Path, name: str) -> None:
    sampling = SAMPLINGS[name]
    engine = TorchEngine(EngineOptions(model_dir=tiny_dir, num_blocks=256, block_size=4))
    await engine.start()
    try:
        whole = await generated(engine, PrefillRequest("whole", PROMPT, sampling))
        assert len(whole) > 24
        for k in (1, 12, 24):
            rest = msgspec.structs.replace(sampling, max_tokens=sampling.max_tokens - k)
            continued = await generated(engine, PrefillRequest(
                f"after-{k}", PROMPT + whole[:k], rest, output_offset=k))
            assert continued == whole[k:], f"continued after {k} tokens"
    finally:
        await engine.close()
