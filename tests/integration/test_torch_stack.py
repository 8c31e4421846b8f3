"""The whole stack on the real engine with the built-in model (HF tokenizer at the gateway)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import openai
import pytest

from engine.protocol import PrefillRequest
from engine.torch_engine import EngineOptions, TorchEngine
from services.gateway.tokenizer import HfTokenizer
from shared.messages import SamplingParams
from tests.stack import Stack, eventually, torch_stack_on

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"


async def reference_tokens(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    engine = TorchEngine(EngineOptions(model_dir=model_dir, num_blocks=64))
    await engine.start()
    try:
        engine.generate(PrefillRequest("ref", prompt, SamplingParams(
            max_tokens=max_tokens, temperature=0.0)))
        tokens: list[int] = []
        while True:
            outputs = await engine.next_step()
            tokens += [o.token_id for o in outputs]
            if outputs and outputs[-1].finish_reason is not None:
                return tokens
    finally:
        await engine.close()


async def test_greedy_chat_through_the_stack_equals_the_engine_alone(
    torch_stack: Stack, tiny_dir: Path,
) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    messages = [{"role": "user", "content": "Tell me a story about a half moon."}]
    prompt = tokenizer.encode(
        "<|im_start|>user\nTell me a story about a half moon.<|im_end|>\n"
        "<|im_start|>assistant\n")
    expected = tokenizer.decode(await reference_tokens(tiny_dir, prompt, 24))
    async with openai.AsyncOpenAI(base_url=torch_stack.base_url, api_key="x",
                                  max_retries=0) as sdk:
        whole = await sdk.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=24, temperature=0.0)
        stream = await sdk.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                   max_tokens=24, temperature=0.0, stream=True)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    assert whole.choices[0].message.content == streamed == expected
    await torch_stack.wait_blocks_free(timeout_s=10)


async def test_a_request_without_sampling_fields_samples_as_the_model_recommends(
        nats_url: str, tiny_dir: Path, tmp_path: Path) -> None:
    """The model's `generation_config.json` says temperature 0: a request that sends no
    temperature is greedy (the engine alone, greedy), whatever its seed; one that sends a
    temperature samples."""
    model = Path(shutil.copytree(tiny_dir, tmp_path / "greedy-by-default"))
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    prompt = HfTokenizer(model).encode("Once upon a time")
    greedy = HfTokenizer(model).decode(await reference_tokens(model, prompt, 12))
    async with torch_stack_on("colocated", nats_url, str(model)) as stack, \
            openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk:
        async def ask(**fields: object) -> str:
            answer = await sdk.completions.create(model=MODEL, prompt="Once upon a time",
                                                  max_tokens=12, **fields)  # type: ignore[call-overload]
            return str(answer.choices[0].text)

        assert {await ask(seed=seed) for seed in range(3)} == {greedy}
        sampled = {await ask(seed=seed, temperature=1.0) for seed in range(3)}
        assert len(sampled) > 1
        await stack.wait_blocks_free(timeout_s=10)


async def test_concurrent_sampled_requests_are_reproducible_by_seed(torch_stack: Stack) -> None:
    async with openai.AsyncOpenAI(base_url=torch_stack.base_url, api_key="x",
                                  max_retries=0) as sdk:
        async def ask(seed: int) -> str:
            response = await sdk.completions.create(model=MODEL, prompt="Once upon a time",
                                                    max_tokens=12, seed=seed, temperature=1.0)
            return response.choices[0].text

        first = await asyncio.gather(*(ask(s) for s in range(6)))
        second = await asyncio.gather(*(ask(s) for s in range(6)))
    assert first == second
    assert len(set(first)) > 1


async def test_model_context_limit_comes_from_the_checkpoint(torch_stack: Stack) -> None:
    status, body = await torch_stack.post("/v1/completions", {
        "model": MODEL, "prompt": "hi", "max_tokens": 4000})
    assert status == 400
    assert "maximum context length is 2048" in body["error"]["message"]


async def test_a_kv_pool_smaller_than_the_context_sets_the_context(
        nats_url: str, tiny_dir: Path) -> None:
    """Workers whose KV pools hold 256 tokens (16 blocks of 16) of a 2048-token model: the
    gateway lists and enforces 256, and a chat that asks no max_tokens ends at 256 tokens.
    Before, such a request outgrew the decode worker's pool, preempted itself, and its
    stream made no progress again until the request timed out."""
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 16}
    async with Stack(nats_url, worker=worker,
                     gateway_options={"model_path": str(tiny_dir)}) as stack:
        status, body = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": "hi", "max_tokens": 300})
        assert status == 400 and "maximum context length is 256" in body["error"]["message"]
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0,
                                      timeout=30) as sdk:
            listed = (await sdk.models.list()).data[0]
            assert listed.model_extra == {"max_model_len": 256}
            reply = await sdk.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Go on and on."}],
                temperature=0.0, extra_body={"ignore_eos": True})
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.total_tokens == 256
        await stack.wait_blocks_free(timeout_s=10)


async def test_a_huge_prompt_holds_up_no_other_request(torch_stack: Stack) -> None:
    """Tokenizing 5 MB of prompt takes the tokenizer a second or more; on the event loop,
    every other request and stream of the gateway waited behind it (and the first two
    seconds of it ran holding the GIL). A request sent meanwhile is answered first now."""
    answered: list[str] = []

    async def post(name: str, prompt: str) -> None:
        status, _ = await torch_stack.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": 1})
        answered.append(f"{name} {status}")

    huge = asyncio.create_task(post("huge", "word " * 1_000_000))
    await asyncio.sleep(0.3)  # its body read, its tokenizing begun
    await post("small", "hi")
    await huge
    assert answered == ["small 200", "huge 400"]  # the huge one is past the context


@pytest.mark.parametrize("policy", ["cache-aware", "least-loaded"])
async def test_cache_aware_routing_sends_a_shared_prefix_to_its_holder(
    nats_url: str, tiny_dir: Path, policy: str,
) -> None:
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256}
    async with Stack(nats_url, num_prefill=2, worker=worker,
                     gateway_options={"model_path": str(tiny_dir)},
                     conductor_options={"policy": policy}) as stack:
        seen: dict[str, int] = {p.worker_id: 0 for p in stack.prefills}
        for prefill in stack.prefills:
            async def observe(msg, worker_id=prefill.worker_id) -> None:  # type: ignore[no-untyped-def]
                seen[worker_id] += 1

            await stack.gateway.nc.subscribe(prefill.subjects.prefill_task(prefill.worker_id),
                                             cb=observe)
        shared = "The key and value cache is stored in blocks. " * 8
        status, _ = await stack.post("/v1/completions", {
            "model": MODEL, "prompt": shared, "max_tokens": 2})
        assert status == 200
        holder = max(seen, key=lambda w: seen[w])
        other = min(seen, key=lambda w: seen[w])
        # The holder's blocks reach the conductor's index through JetStream.
        await eventually(lambda: len(stack.conductor.prefix_index) >= 4, timeout_s=5)
        # Concurrent follow-ups: least-loaded spreads them, cache-aware keeps the prefix hot.
        results = await asyncio.gather(*(stack.post("/v1/completions", {
            "model": MODEL, "prompt": f"{shared} Question {i}?", "max_tokens": 2})
            for i in range(6)))
        assert [status for status, _ in results] == [200] * 6
        await eventually(lambda: sum(seen.values()) == 7)
        if policy == "cache-aware":
            assert seen == {holder: 7, other: 0}
        else:
            assert seen[other] > 0


async def test_a_dead_decode_worker_is_replaced_mid_stream_without_a_lost_token(
    nats_url: str, tiny_dir: Path,
) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    prompt_text = "Once upon a time, there was a half moon."
    expected_ids = await reference_tokens(tiny_dir, tokenizer.encode(prompt_text), 400)
    worker = {"engine": "torch", "model_path": str(tiny_dir), "num_blocks": 256}
    async with (
        Stack(nats_url, num_decode=2, worker=worker,
              gateway_options={"model_path": str(tiny_dir)}) as stack,
        openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as sdk,
    ):
        stream = await sdk.completions.create(
            model=MODEL, prompt=prompt_text, max_tokens=400, temperature=0.0,
            stream=True, stream_options={"include_usage": True})
        texts, usage, killed = [], None, None
        async for chunk in stream:
            texts += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
            if killed is None and len(texts) == 30:
                killed = next(d for d in stack.decodes
                              if d.engine.stats().num_running == 1)
                await killed._cancel_tasks()  # dies: no steps, no heartbeats, no goodbye
                await killed.nc.close()
                stack.decodes.remove(killed)
    assert killed is not None
    assert "".join(texts) == tokenizer.decode(expected_ids)
    assert usage is not None and usage.completion_tokens == 400
