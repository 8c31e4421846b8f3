"""The OpenAI contract through the `openai` SDK against a real stack on the torch engine,
disaggregated (prefill's first token, decode's later ones) and colocated: logprobs equal to
transformers', echo with prompt logprobs, every prompt form, sampling controls, strict 400s."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from services.gateway.token_filters import bad_word_sequences
from services.gateway.tokenizer import HfTokenizer
from tests.engine.hf_models import greedy_reference, hf_model
from tests.stack import PATHS, Stack, torch_stack_on

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
PROMPT = "The half moon rose over the quiet harbour"
NUM_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> Any:
    return hf_model(tiny_dir)


@pytest.fixture(params=PATHS)
async def stack(request: pytest.FixtureRequest, nats_url: str, tiny_dir: Path
                ) -> AsyncIterator[Stack]:
    async with torch_stack_on(request.param, nats_url, str(tiny_dir)) as running:
        yield running


@pytest.fixture
async def sdk(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
        yield client


async def test_completion_logprobs_equal_transformers_streamed_and_not(
        sdk: openai.AsyncOpenAI, stack: Stack, tiny_dir: Path, reference: Any) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    tokens, log_probs = greedy_reference(reference, prompt, NUM_TOKENS)
    expected = [log_probs[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
    whole = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                         temperature=0, logprobs=3, extra_body={
                                             "ignore_eos": True})
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    for i, top in enumerate(logprobs.top_logprobs):
        best = torch.topk(log_probs[len(prompt) - 1 + i], 3).indices.tolist()
        assert top is not None
        assert {tokenizer.decode([t], skip_special_tokens=False) for t in best} <= set(top)
    assert logprobs.text_offset[0] == 0
    assert whole.choices[0].text.startswith(logprobs.tokens[0])

    stream = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                          temperature=0, logprobs=3, stream=True,
                                          extra_body={"ignore_eos": True})
    streamed: list[float | None] = []
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.token_logprobs:
                streamed += choice.logprobs.token_logprobs
    assert streamed == pytest.approx(expected, abs=1e-4)
    await stack.wait_blocks_free(timeout_s=10)


async def test_echo_returns_prompt_logprobs_and_max_tokens_zero_the_prompt_alone(
        sdk: openai.AsyncOpenAI, tiny_dir: Path, reference: Any) -> None:
    """How evaluation harnesses score loglikelihood: token-id prompts, echo, logprobs."""
    tokenizer = HfTokenizer(tiny_dir)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    with torch.no_grad():
        log_probs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
    expected = [log_probs[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    only = await sdk.completions.create(model=MODEL, prompt=[prompt], max_tokens=0, echo=True,
                                        logprobs=1, temperature=0)
    choice = only.choices[0]
    assert choice.text == tokenizer.decode(prompt) and choice.finish_reason == "length"
    assert only.usage is not None and only.usage.completion_tokens == 0
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)
    assert len(choice.logprobs.tokens or []) == len(prompt)

    more = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True,
                                        logprobs=0, temperature=0,
                                        extra_body={"ignore_eos": True})
    choice = more.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == len(prompt) + 2
    assert choice.logprobs.token_logprobs[1:len(prompt)] == pytest.approx(expected, abs=1e-4)


async def test_prompt_logprobs_give_each_prompt_token_its_logprob_rank_and_top(
        sdk: openai.AsyncOpenAI, tiny_dir: Path, reference: Any) -> None:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null) the token's own logprob
    and rank under the model, then the k most likely, keyed by token id; on each completion
    choice, and on a chat response."""
    tokenizer = HfTokenizer(tiny_dir)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    with torch.no_grad():
        log_probs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
    answer = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                          temperature=0, extra_body={"prompt_logprobs": 2})
    scored = answer.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for position, token in enumerate(prompt[1:], start=1):
        row = log_probs[position - 1]
        own = scored[position][str(token)]
        assert own["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        assert own["rank"] == int((row > row[token]).sum()) + 1
        assert own["decoded_token"] == tokenizer.decode([token], skip_special_tokens=False)
        best = torch.topk(row, 2).indices.tolist()
        assert {str(t) for t in best} <= set(scored[position])
        assert scored[position][str(best[0])]["rank"] == 1
        assert len(scored[position]) == 3 - (token in best)
    chat = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name the moon."}], max_tokens=1,
        extra_body={"prompt_logprobs": 0})
    scored = chat.model_dump()["prompt_logprobs"]
    assert chat.usage is not None and len(scored) == chat.usage.prompt_tokens
    assert scored[0] is None and all(len(position) == 1 for position in scored[1:])


async def test_a_long_prompt_s_logprobs_cross_nats_in_pieces(
        sdk: openai.AsyncOpenAI, reference: Any) -> None:
    """2,000 prompt tokens with 20 alternatives each are over NATS' 1 MiB payload as one
    message (a 500 before): they cross in pieces ahead of the first token and come back
    whole, for `prompt_logprobs` and for `echo` with `logprobs` alike."""
    prompt = [10 + (7 * i) % 900 for i in range(2000)]
    with torch.no_grad():
        log_probs = torch.log_softmax(reference(torch.tensor([prompt])).logits[0].float(), -1)
    answer = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                          extra_body={"prompt_logprobs": 20})
    scored = answer.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    assert all(len(position) >= 20 for position in scored[1:])
    for position in (1, 999, 1000, 1999):
        own = scored[position][str(prompt[position])]
        assert own["logprob"] == pytest.approx(log_probs[position - 1, prompt[position]].item(),
                                               abs=1e-4)
    echoed = await sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True,
                                          logprobs=20)
    logprobs = echoed.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == len(prompt) + 1
    assert logprobs.token_logprobs[1:len(prompt)] == pytest.approx(
        [log_probs[i - 1, prompt[i]].item() for i in range(1, len(prompt))], abs=1e-4)


async def test_chat_logprobs_streamed_equal_whole(sdk: openai.AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": "Name the moon."}]
    whole = await sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NUM_TOKENS, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == NUM_TOKENS
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
               for entry in content)  # greedy: the chosen token is the most likely one
    text = bytes(b for entry in content for b in (entry.bytes or [])).decode(errors="replace")
    assert text.replace("\ufffd", "") == (whole.choices[0].message.content or "")
    stream = await sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NUM_TOKENS, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    streamed = [entry async for chunk in stream for choice in chunk.choices
                if choice.logprobs is not None for entry in choice.logprobs.content or []]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in content]


async def test_every_prompt_form_gives_one_choice_per_prompt(
        sdk: openai.AsyncOpenAI, tiny_dir: Path) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    texts = ["Once upon a time", "The harbour at night", "A half moon"]
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    options: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0,
                               "extra_body": {"ignore_eos": True}}
    singles = [(await sdk.completions.create(prompt=t, **options)).choices[0].text
               for t in texts]
    for prompt in (texts, ids):
        response = await sdk.completions.create(prompt=prompt, **options)
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert [c.text for c in response.choices] == singles
        assert response.usage is not None
        assert response.usage.prompt_tokens == sum(len(i) for i in ids)
        assert response.usage.completion_tokens == 15
    assert (await sdk.completions.create(prompt=ids[0], **options)).choices[0].text == singles[0]
    stream = await sdk.completions.create(prompt=ids, stream=True,
                                          stream_options={"include_usage": True}, **options)
    streamed = ["", "", ""]
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
        usage = chunk.usage or usage
    assert streamed == singles and usage is not None and usage.completion_tokens == 15


async def test_sampling_controls_shape_the_output(sdk: openai.AsyncOpenAI, tiny_dir: Path
                                                  ) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    forced = tokenizer.encode(" moon")[0]
    biased = await sdk.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=1,
        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode([forced] * 4)
    plain = await sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
    penalized = await sdk.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, frequency_penalty=2.0,
        presence_penalty=2.0, extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
    plain_ids = tokenizer.encode(plain.choices[0].text)
    penalized_ids = tokenizer.encode(penalized.choices[0].text)
    assert len(set(penalized_ids)) >= len(set(plain_ids))
    assert penalized.choices[0].text != plain.choices[0].text


async def test_token_filters_keep_tokens_out_of_the_output(sdk: openai.AsyncOpenAI,
                                                          tiny_dir: Path) -> None:
    """`allowed_token_ids` and `bad_words` on prefill's first token and decode's later
    ones: sampled only from the allowed; greedy, a word of the plain output banned."""
    allowed = [5, 40, 77, 300]
    sampled = await sdk.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                    "return_token_ids": True})
    drawn = sampled.choices[0].model_extra["token_ids"]
    assert len(drawn) == 12 and set(drawn) <= set(allowed)
    tokenizer = HfTokenizer(tiny_dir)
    options = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    plain = (await sdk.completions.create(**options, extra_body={
        "ignore_eos": True, "return_token_ids": True})).choices[0].model_extra["token_ids"]
    word = next(w for w in (tokenizer.decode([t]).strip() for t in plain)
                if w and any(_holds(plain, s) for s in bad_word_sequences([w], tokenizer)))
    filtered = (await sdk.completions.create(**options, extra_body={
        "ignore_eos": True, "return_token_ids": True, "bad_words": [word]})
                ).choices[0].model_extra["token_ids"]
    assert filtered != plain and len(filtered) == 12
    assert not any(_holds(filtered, s) for s in bad_word_sequences([word], tokenizer))


def _holds(token_ids: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(token_ids[i:i + len(sequence)]) == sequence
               for i in range(len(token_ids) - len(sequence) + 1))


async def test_a_seeded_sampled_request_is_the_same_disaggregated_and_colocated(
        nats_url: str, tiny_dir: Path) -> None:
    """One sampler, and randomness addressed by output position: prefill's first token and
    decode's next ones continue the stream a single worker would draw."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 1.0,
            "seed": 11, "top_k": 50, "min_p": 0.01, "frequency_penalty": 0.5,
            "repetition_penalty": 1.1, "ignore_eos": True}
    texts = []
    for path in PATHS:
        async with torch_stack_on(path, nats_url, str(tiny_dir)) as stack:
            status, answer = await stack.post("/v1/completions", body)
            assert status == 200, answer
            texts.append(answer["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": 21}, "logprobs"),
    ({"n": 129}, "n"),
    ({"best_of": 129}, "best_of"),
    ({"best_of": 2, "n": 3}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"priority": 2}, "priority"),
    ({"seed": 2**63}, "seed"),
    ({"frobnicate": True}, "frobnicate"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {"required": ["a"]}}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
])
async def test_bad_input_gets_its_400_and_the_stack_keeps_serving(
        stack: Stack, extra: dict[str, Any], param: str) -> None:
    status, body = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                         "max_tokens": 2, **extra})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    status, body = await stack.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "top_logprobs": 3})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    status, body = await stack.post("/v1/completions", {"model": MODEL, "prompt": "hi",
                                                         "max_tokens": 2})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


async def test_the_sync_sdk_gets_logprobs_too(stack: Stack) -> None:
    def ask() -> Any:  # in a thread: the stack serves on this test's event loop
        with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
            return client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                temperature=0, logprobs=True, extra_body={"ignore_eos": True})

    response = await asyncio.to_thread(ask)
    assert response.choices[0].logprobs is not None
    assert len(response.choices[0].logprobs.content or []) == 3
