"""vLLM's tokenizer routes on the built-in model: `/tokenize` counts what a request will
cost (a chat's messages exactly as the chat route renders them), `/detokenize` inverts it,
bad input is a 400, and both sit behind the API key as /v1 does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from services.gateway.tokenizer import HfTokenizer
from tests.stack import Stack

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
MESSAGES = [{"role": "user", "content": "Where does the half moon rise?"}]


async def post(stack: Stack, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{stack.gateway.url}{path}", json=body, headers=headers) as response:
        return response.status, await response.json()


async def test_a_prompt_tokenizes_as_completions_count_it(
        module_stack: Stack, sdk: openai.AsyncOpenAI, tiny_dir: Path) -> None:
    status, body = await post(module_stack, "/tokenize", {
        "model": MODEL, "prompt": "The half moon rose", "return_token_strs": True})
    completion = await sdk.completions.create(model=MODEL, prompt="The half moon rose",
                                              max_tokens=1)
    assert status == 200 and completion.usage is not None
    assert body["count"] == len(body["tokens"]) == completion.usage.prompt_tokens
    assert body["max_model_len"] == 2048
    assert "".join(body["token_strs"]) == HfTokenizer(tiny_dir).decode(
        body["tokens"], skip_special_tokens=False)


async def test_messages_tokenize_as_the_chat_route_renders_them(
        module_stack: Stack, sdk: openai.AsyncOpenAI) -> None:
    status, body = await post(module_stack, "/tokenize", {"model": MODEL, "messages": MESSAGES})
    chat = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                             max_tokens=1)
    assert status == 200 and chat.usage is not None
    assert body["count"] == chat.usage.prompt_tokens and body["token_strs"] is None
    _, closed = await post(module_stack, "/tokenize", {
        "model": MODEL, "messages": MESSAGES, "add_generation_prompt": False})
    assert closed["count"] < body["count"]


async def test_detokenize_inverts_tokenize(module_stack: Stack) -> None:
    _, body = await post(module_stack, "/tokenize", {"model": MODEL, "prompt": "héllo, moon",
                                                     "add_special_tokens": False})
    status, text = await post(module_stack, "/detokenize",
                              {"model": MODEL, "tokens": body["tokens"]})
    assert status == 200 and text == {"prompt": "héllo, moon"}


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MESSAGES}, 400, "prompt"),
    ("/tokenize", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "extra": 1}, 400, "extra"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10 ** 9]}, 400, "tokens"),
])
async def test_bad_input_is_an_openai_error(module_stack: Stack, path: str, body: Any,
                                            status: int, param: str) -> None:
    got, answer = await post(module_stack, path, body)
    assert got == status and answer["error"]["param"] == param


async def test_the_routes_need_the_api_key_when_one_is_set(nats_url: str) -> None:
    async with Stack(nats_url, gateway_options={"api_key": "s3cret"}) as stack:
        for path, body in (("/tokenize", {"model": MODEL, "prompt": "a"}),
                           ("/detokenize", {"model": MODEL, "tokens": [97]})):
            assert (await post(stack, path, body))[0] == 401
            status, _ = await post(stack, path, body, Authorization="Bearer s3cret")
            assert status == 200
