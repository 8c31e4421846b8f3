"""The disaggregated data path on the real engine: each request's KV is computed on a
prefill worker and streamed, layer by layer, into the decode worker's reserved blocks over
shared memory or TCP; decode continues from it. Outputs must equal the engine alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.builtin_model import write_builtin_model
from engine.protocol import PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from services.gateway.tokenizer import HfTokenizer
from shared.messages import SamplingParams
from tests.stack import Stack

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
PROMPTS = [
    "Once upon a time",
    "The key and value cache is stored in blocks of sixteen tokens each, and a block "
    "holds every layer's keys and values for its tokens. " * 3,
    "A half moon rose over the quiet harbour while the fishermen mended their nets.",
    "Prefill computes the prompt; decode produces one token per step.",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_builtin_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def expected(tiny_dir: Path) -> dict[str, list[int]]:
    """Greedy tokens from the engine alone, one process, no disaggregation."""
    tokenizer = HfTokenizer(tiny_dir)

    async def generate_all() -> dict[str, list[int]]:
        engine = TorchEngine(EngineOptions(model_dir=tiny_dir, num_blocks=256))
        await engine.start()
        try:
            results = {}
            for prompt in PROMPTS:
                engine.generate(PrefillRequest(prompt, tokenizer.encode(prompt), SamplingParams(
                    max_tokens=16, temperature=0.0, ignore_eos=True)))
                tokens: list[int] = []
                while len(tokens) < 16:
                    tokens += [o.token_id for o in await engine.next_step()]
                results[prompt] = tokens
            return results
        finally:
            await engine.close()

    return asyncio.run(generate_all())


@pytest.fixture
async def make_stack(nats_url: str, tiny_dir: Path) -> AsyncIterator[object]:
    stacks: list[Stack] = []

    async def make(**worker: object) -> Stack:
        options = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256, **worker}
        stack = Stack(nats_url, worker=options, gateway_options={"model_path": str(tiny_dir)})
        stacks.append(stack)
        return await stack.start()

    yield make
    for stack in stacks:
        await stack.stop()


async def complete_all(stack: Stack, tokenizer: HfTokenizer) -> dict[str, list[int]]:
    async def complete(prompt: str) -> list[int]:
        status, body = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        assert status == 200, body
        return tokenizer.encode(body["choices"][0]["text"])

    outputs = await asyncio.gather(*(complete(prompt) for prompt in PROMPTS))
    return dict(zip(PROMPTS, outputs, strict=True))


@pytest.mark.parametrize(("transports", "streaming", "transport"), [
    ("shm,tcp", "layerwise", "shm"),
    ("tcp", "layerwise", "tcp"),
    ("tcp", "whole", "tcp"),
])
async def test_streamed_kv_gives_the_engines_own_greedy_output(
        make_stack, tiny_dir: Path, expected: dict[str, list[int]],  # type: ignore[no-untyped-def]
        transports: str, streaming: str, transport: str) -> None:
    stack: Stack = await make_stack(transfer_transports=transports, kv_streaming=streaming)
    tokenizer = HfTokenizer(tiny_dir)
    first = await complete_all(stack, tokenizer)
    second = await complete_all(stack, tokenizer)  # now from prefill's prefix cache
    expected_text = {p: tokenizer.decode(t) for p, t in expected.items()}
    assert {p: tokenizer.decode(t) for p, t in first.items()} == expected_text
    assert {p: tokenizer.decode(t) for p, t in second.items()} == expected_text
    (decode,) = stack.decodes
    assert decode.kv_commits == {transport: 2 * len(PROMPTS)}  # the KV did cross, each time
    await stack.wait_blocks_free(timeout_s=10)
