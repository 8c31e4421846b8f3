"""The OpenAI API end to end, through the official `openai` SDK, against a running stack."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from engine.fake_engine import fake_completion
from services.gateway.chat_template import ChatTemplate
from services.gateway.tokenizer import ByteTokenizer
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
TOKENIZER = ByteTokenizer()


def expected_text(prompt: str | list[int], seed: int | None, num_tokens: int) -> str:
    ids = TOKENIZER.encode(prompt) if isinstance(prompt, str) else prompt
    return TOKENIZER.decode(fake_completion(ids, seed, num_tokens))


def chat_prompt(content: str) -> str:
    return ChatTemplate().render([{"role": "user", "content": content}],
                                 bos_token=TOKENIZER.bos_token, eos_token=TOKENIZER.eos_token)


@pytest.fixture
async def client(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused",
                                  max_retries=0) as sdk:
        yield sdk


async def test_chat_completion_returns_the_engine_output_with_usage(
    client: openai.AsyncOpenAI,
) -> None:
    response = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, seed=5,
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(chat_prompt("hello"), 5, 12)
    assert choice.finish_reason == "length"
    prompt_len = len(TOKENIZER.encode(chat_prompt("hello")))
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens,
            response.usage.total_tokens) == (prompt_len, 12, prompt_len + 12)


async def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(
    client: openai.AsyncOpenAI,
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=12, seed=5,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(chat_prompt("hello"), 5, 12)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_completion_streamed_and_not_agree(client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model=MODEL, prompt="abc", max_tokens=20, seed=1)
    stream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=20, seed=1,
                                             stream=True)
    streamed = "".join([c.choices[0].text async for c in stream])
    assert whole.choices[0].text == streamed == expected_text("abc", 1, 20)
    assert whole.usage is not None and whole.usage.completion_tokens == 20


async def test_max_completion_tokens_limits_chat(client: openai.AsyncOpenAI) -> None:
    response = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=3)
    assert response.usage is not None and response.usage.completion_tokens == 3


async def test_completions_default_to_sixteen_tokens(client: openai.AsyncOpenAI) -> None:
    response = await client.completions.create(model=MODEL, prompt="abc")
    assert response.usage is not None and response.usage.completion_tokens == 16


async def test_prompt_as_token_ids(client: openai.AsyncOpenAI) -> None:
    response = await client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=5)
    assert response.choices[0].text == expected_text([104, 105], None, 5)


async def test_seed_changes_the_output(client: openai.AsyncOpenAI) -> None:
    a = await client.completions.create(model=MODEL, prompt="x", max_tokens=16, seed=1)
    b = await client.completions.create(model=MODEL, prompt="x", max_tokens=16, seed=2)
    assert a.choices[0].text != b.choices[0].text


@pytest.mark.parametrize(("is_stream", "is_included"), [(False, False), (True, False),
                                                        (False, True), (True, True)])
async def test_stop_string_cuts_the_output_and_frees_the_request(
    stack: Stack, client: openai.AsyncOpenAI, is_stream: bool, is_included: bool,
) -> None:
    full = expected_text("stop me", 9, 64)
    stop = full[10:12]
    response = await client.completions.create(
        model=MODEL, prompt="stop me", max_tokens=64, seed=9, stop=[stop], stream=is_stream,
        extra_body={"include_stop_str_in_output": is_included},
    )
    if is_stream:
        chunks = [c async for c in response]  # type: ignore[union-attr]
        text = "".join(c.choices[0].text for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        text, finish = response.choices[0].text, response.choices[0].finish_reason  # type: ignore[union-attr]
    assert text == full[: full.index(stop) + (len(stop) if is_included else 0)]
    assert finish == "stop"
    await stack.wait_blocks_free()


async def test_models_lists_the_served_model_with_its_context_length(
        client: openai.AsyncOpenAI) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].max_model_len == 2048  # type: ignore[attr-defined]  # vLLM's field
    one = await client.models.retrieve(MODEL)
    assert one == models.data[0]  # the same entry, `created` included
    for missing in ("no-such-model", "org/no-such-model"):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.models.retrieve(missing)
        assert caught.value.code == "model_not_found"
        assert caught.value.body["param"] == "model"  # type: ignore[index]


async def test_concurrent_requests_each_get_their_own_output(client: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=f"p{i}", max_tokens=8 + i, seed=i, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    results = await asyncio.gather(*(one(i) for i in range(24)))
    assert results == [expected_text(f"p{i}", i, 8 + i) for i in range(24)]


async def test_client_disconnect_aborts_the_request_downstream(nats_url: str) -> None:
    async with Stack(nats_url, worker={"fake_token_delay_s": 0.05}) as stack:
        async with aiohttp.ClientSession() as session:
            response = await session.post(
                f"{stack.base_url}/completions",
                json={"model": MODEL, "prompt": "long", "max_tokens": 500, "stream": True})
            await response.content.readline()
            await eventually(lambda: stack.decodes[0].engine.stats().num_running == 1)
            response.close()
        await eventually(lambda: stack.decodes[0].engine.stats().num_running == 0)
        await stack.wait_blocks_free()
        await eventually(lambda: len(stack.gateway.table) == 0)
        # Counted as the client's going (nginx's 499), not as a server error.
        await eventually(lambda: stack.gateway.metrics.registry.get_sample_value(
            "halfmoon_requests_total",
            {"route": "/v1/completions", "status": "499"}) == 1)


async def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(
    client: openai.AsyncOpenAI,
) -> None:
    prompt = list(range(1, 41))  # two full 16-token blocks and a partial one

    async def cached_tokens() -> int:
        response = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert response.usage is not None and response.usage.prompt_tokens_details is not None
        return response.usage.prompt_tokens_details.cached_tokens or 0

    assert await cached_tokens() == 0
    assert await cached_tokens() == 32


# The request bodies the load generators send by default (guidellm 0.8 for fixed output
# lengths; aiperf 0.13 for chat), byte for byte in their fields.
GUIDELLM_COMPLETIONS = {"model": MODEL, "prompt": "benchmark me", "stream": True,
                        "stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True},
                        "max_tokens": 6, "stop": None, "ignore_eos": True}
GUIDELLM_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "benchmark me"}],
                 "stream": True, "stream_options": {"include_usage": True,
                                                    "continuous_usage_stats": True},
                 "max_completion_tokens": 6, "stop": None, "ignore_eos": True}
AIPERF_CHAT = {"messages": [{"role": "user", "content": "benchmark me"}], "model": MODEL,
               "stream": True, "max_completion_tokens": 6,
               "stream_options": {"include_usage": True}}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", GUIDELLM_COMPLETIONS), ("/v1/chat/completions", GUIDELLM_CHAT),
    ("/v1/chat/completions", AIPERF_CHAT)])
async def test_load_generators_default_bodies_are_served(
        stack: Stack, path: str, body: dict[str, object]) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{stack.gateway.url}{path}", json=body) as response:
        assert response.status == 200, await response.text()
        events = [line[6:] for line in (await response.text()).splitlines()
                  if line.startswith("data: {")]
    chunks = [json.loads(e) for e in events]
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    continuous = body["stream_options"].get("continuous_usage_stats")  # type: ignore[union-attr]
    with_choices = [c for c in chunks if c["choices"]]
    if continuous:  # usage so far on every chunk, growing
        counts = [c["usage"]["completion_tokens"] for c in with_choices]
        assert counts == sorted(counts) and counts[-1] == 6
    else:
        assert all(c["usage"] is None for c in with_choices)


# lm-eval 0.4's `local-completions` bodies: scoring continuations (token ids, echoed with
# logprobs) and generating until stop strings (a task's `until` and the EOS: HumanEval's
# five and one make six, a 400 while the gateway took OpenAI's four at most). lm-eval 0.4.13
# itself ran against `halfmoon up` (disaggregated) with a local multiple-choice task: its 32
# continuations' loglikelihoods equal transformers' on the same weights within 1e-6.
LM_EVAL_LOGLIKELIHOOD = {"model": MODEL, "prompt": [[72, 105, 33], [72, 111]], "temperature": 0,
                         "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
LM_EVAL_GENERATE = {"prompt": ["def f(x):\n    return"], "model": MODEL, "max_tokens": 8,
                    "temperature": 0, "stop": ["\nclass", "\ndef", "\n#", "\nif", "\nprint",
                                               "<|endoftext|>"], "seed": 1234}


async def test_an_evaluation_harness_s_bodies_are_served(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{stack.gateway.url}/v1/completions",
                                json=LM_EVAL_LOGLIKELIHOOD) as response:
            assert response.status == 200, await response.text()
            scored = (await response.json())["choices"]
        async with session.post(f"{stack.gateway.url}/v1/completions",
                                json=LM_EVAL_GENERATE) as response:
            assert response.status == 200, await response.text()
            generated = (await response.json())["choices"]
    # One choice per prompt, in order (their logprobs against transformers' on the torch
    # engine: `test_echo_returns_prompt_logprobs_and_max_tokens_zero_the_prompt_alone`).
    assert [choice["index"] for choice in scored] == [0, 1]
    assert generated[0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
])
async def test_a_stream_is_neither_cached_nor_buffered_by_a_proxy(
        stack: Stack, path: str, body: dict[str, Any]) -> None:
    """nginx in front of the gateway would hold a stream to its end without
    `X-Accel-Buffering: no`."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{stack.gateway.url}{path}", json={"model": MODEL, "stream": True, **body}
    ) as response:
        assert response.status == 200
        assert response.content_type == "text/event-stream"
        assert response.headers["Cache-Control"] == "no-cache"
        assert response.headers["X-Accel-Buffering"] == "no"
        assert (await response.read()).rstrip().endswith(
            b"data: [DONE]" if path != "/v1/responses" else b"}")


async def test_responses_carry_the_clients_x_request_id_or_a_new_one(stack: Stack) -> None:
    """`x-request-id` on every /v1 response, as OpenAI sends it: the client's own id back
    (streamed or not, errors too), a new one when the client sent none or one that is not
    safe to send back in a header."""
    url = stack.gateway.url
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
    async with aiohttp.ClientSession() as session:
        for extra in ({}, {"stream": True}):
            async with session.post(f"{url}/v1/completions", json={**body, **extra},
                                    headers={"X-Request-Id": "client-7/a",
                                             "Origin": "https://app.example.com"}) as response:
                assert response.status == 200
                assert response.headers["x-request-id"] == "client-7/a"
                assert "Access-Control-Allow-Origin" not in response.headers  # CORS is off
                await response.read()
        async with session.post(f"{url}/v1/completions", json={**body, "max_tokens": 0},
                                headers={"X-Request-Id": "bad-one"}) as response:
            assert response.status == 400
            assert response.headers["x-request-id"] == "bad-one"
        ids = set()
        for header in ({}, {"X-Request-Id": "has space"}, {"X-Request-Id": "x" * 257}):
            async with session.get(f"{url}/v1/models", headers=header) as response:
                assert response.status == 200
                ids.add(response.headers["x-request-id"])
        assert len(ids) == 3 and all(i.startswith("req-") for i in ids)
        async with session.get(f"{url}/health") as response:
            assert "x-request-id" not in response.headers  # the OpenAI API's routes only


async def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
        client: openai.AsyncOpenAI) -> None:
    prompt = "a prompt much longer than what is kept of it"
    ids = TOKENIZER.encode(prompt)
    kept = ids[-5:]
    cut = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=4,
                                          echo=True,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage is not None and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == TOKENIZER.decode(kept) + expected_text(kept, 4, 6)
    whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, seed=4,
                                            extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    models = await client.models.list()
    context = models.model_dump()["data"][0]["max_model_len"]
    fitted = await client.completions.create(  # -1: cut to what leaves room for the output
        model=MODEL, prompt="x" * (context + 50), max_tokens=10,
        extra_body={"truncate_prompt_tokens": -1})
    assert fitted.usage is not None and fitted.usage.prompt_tokens == context - 10
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage is not None and chat.usage.prompt_tokens == 7
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                        extra_body={"truncate_prompt_tokens": 0})
    assert refused.value.body["param"] == "truncate_prompt_tokens"  # type: ignore[index]


# The fields OpenAI's OpenAPI document marks required, per object: clients generated from it
# (and strict validators) reject a body without them, even where the value is null.
REQUIRED = {
    "chat.completion": ({"id", "object", "created", "model", "choices"},
                        {"index", "message", "logprobs", "finish_reason"}),
    "chat.completion.chunk": ({"id", "object", "created", "model", "choices"},
                              {"index", "delta", "finish_reason"}),
    "text_completion": ({"id", "object", "created", "model", "choices"},
                        {"index", "text", "logprobs", "finish_reason"}),
}


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
@pytest.mark.parametrize("stream", [False, True])
async def test_bodies_carry_every_field_openais_schema_requires(
        stack: Stack, path: str, body: dict[str, Any], stream: bool) -> None:
    async with aiohttp.ClientSession() as session, session.post(
            f"{stack.gateway.url}{path}",
            json={"model": MODEL, "max_tokens": 3, "stream": stream, **body}) as response:
        assert response.status == 200
        text = await response.text()
    objects = [json.loads(line[6:]) for line in text.splitlines()
               if line.startswith("data: {")] if stream else [json.loads(text)]
    assert objects
    for obj in objects:
        top, per_choice = REQUIRED[obj["object"]]
        assert top <= obj.keys()
        for choice in obj["choices"]:
            assert per_choice <= choice.keys()
            if "message" in choice:
                assert {"role", "content", "refusal"} <= choice["message"].keys()
