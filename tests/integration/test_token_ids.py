"""vLLM's token-id extensions on the real engine: `return_token_ids` (the prompt's and the
output's ids beside the text, whole and streamed) and `return_tokens_as_token_ids` (logprobs
naming tokens `token_id:N`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from services.gateway.tokenizer import HfTokenizer
from tests.stack import Stack

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
PROMPT = "The half moon rose over the quiet harbour"
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}
IDS = {"return_token_ids": True}


async def test_a_completion_returns_its_prompt_and_output_ids_whole_and_streamed(
        sdk: openai.AsyncOpenAI, module_stack: Stack, tiny_dir: Path) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    whole = await sdk.completions.create(model=MODEL, prompt=PROMPT, extra_body=IDS,
                                         **GREEDY)
    choice = whole.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 8 == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert tokenizer.decode(choice["token_ids"]) == choice["text"]

    stream = await sdk.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                          extra_body=IDS, **GREEDY)
    chunks = [chunk.model_dump()["choices"][0] async for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    await module_stack.wait_blocks_free()


async def test_a_chat_completion_returns_ids_for_every_choice(
        sdk: openai.AsyncOpenAI, module_stack: Stack, tiny_dir: Path) -> None:
    tokenizer = HfTokenizer(tiny_dir)
    messages: Any = [{"role": "user", "content": PROMPT}]
    whole = (await sdk.chat.completions.create(
        model=MODEL, messages=messages, n=2, seed=3, max_tokens=6,
        extra_body=IDS)).model_dump()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    for choice in whole["choices"]:
        assert len(choice["token_ids"]) == 6
        assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]

    stream = await sdk.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                               extra_body=IDS, **GREEDY)
    chunks = [chunk.model_dump() async for chunk in stream]
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for c in chunks for choice in c["choices"]
                for t in choice.get("token_ids") or []]
    plain = await sdk.chat.completions.create(model=MODEL, messages=messages, extra_body=IDS,
                                              **GREEDY)
    assert streamed == plain.model_dump()["choices"][0]["token_ids"]
    await module_stack.wait_blocks_free()


async def test_logprobs_name_tokens_by_id_when_asked(
        sdk: openai.AsyncOpenAI, module_stack: Stack) -> None:
    extra = {**IDS, "return_tokens_as_token_ids": True}
    completion = (await sdk.completions.create(model=MODEL, prompt=PROMPT, logprobs=2,
                                               extra_body=extra, **GREEDY)).model_dump()
    choice = completion["choices"][0]
    named = [f"token_id:{t}" for t in choice["token_ids"]]
    assert choice["logprobs"]["tokens"] == named
    for token, top in zip(named, choice["logprobs"]["top_logprobs"], strict=True):
        assert token in top and all(key.startswith("token_id:") for key in top)

    chat = (await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], logprobs=True,
        top_logprobs=2, extra_body=extra, **GREEDY)).model_dump()
    entries = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in entries] == \
        [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert all(e["bytes"] for e in entries)  # the tokens' own bytes
    await module_stack.wait_blocks_free()
