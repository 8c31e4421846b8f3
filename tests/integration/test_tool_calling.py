"""Tool calling through the `openai` SDK on the built-in model (random weights): a forced
call (`required` or a named function) is well formed and its arguments validate against the
function's parameters, whole and streamed; history with calls and results is served."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.stack import Stack, torch_stack_on

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture
async def sdk(nats_url: str, tiny_dir: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    async with torch_stack_on("disaggregated", nats_url, str(tiny_dir), num_blocks=1536,
                              ) as stack, openai.AsyncOpenAI(
            base_url=stack.base_url, api_key="x", max_retries=0, timeout=120) as client:
        yield client


def check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


@dataclass
class StreamedChat:
    """One streamed chat choice as a client gathers it."""

    content: str = ""
    finish: str | None = None
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # by index: name, arguments
    num_pieces: int = 0  # chunks that carried arguments


async def gathered(stream: Any) -> StreamedChat:
    got = StreamedChat()
    async for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            # Text held back while it may be a call sends nothing, not empty deltas.
            assert (delta.content is not None or delta.role or delta.tool_calls
                    or choice.finish_reason)
            got.content += delta.content or ""
            got.finish = choice.finish_reason or got.finish
            for call in delta.tool_calls or []:
                assert call.function is not None
                entry = got.calls.setdefault(call.index, {"name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
                got.num_pieces += bool(call.function.arguments)
    return got


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "add"}}])
async def test_a_forced_call_is_well_formed(sdk: openai.AsyncOpenAI, choice: Any) -> None:
    allowed = {"get_weather", "add"} if choice == "required" else {"add"}

    async def whole(seed: int) -> None:
        response = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=128, temperature=1.0, seed=seed)
        choice_ = response.choices[0]
        assert choice_.finish_reason == "tool_calls"
        calls = choice_.message.tool_calls or []
        assert len(calls) == 1 and calls[0].type == "function" and calls[0].id
        check_call(calls[0].function.name, calls[0].function.arguments, allowed)

    async def streamed(seed: int) -> int:
        """Checks one streamed call; returns how many chunks carried its arguments."""
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=128, temperature=1.0, seed=seed, stream=True)
        got = await gathered(stream)
        assert got.finish == "tool_calls" and got.content == "" and len(got.calls) == 1
        check_call(got.calls[0]["name"], got.calls[0]["arguments"], allowed)
        return got.num_pieces

    _, pieces = await asyncio.gather(asyncio.gather(*(whole(seed) for seed in range(10))),
                                     asyncio.gather(*(streamed(seed) for seed in range(10, 20))))
    assert all(num_pieces > 1 for num_pieces in pieces)  # arguments as they come


async def test_a_forced_call_cut_short_is_a_partial_call_never_markup(
        sdk: openai.AsyncOpenAI) -> None:
    """max_tokens ends a forced call: finish_reason `length`, no `<tool_call>` markup in the
    content; once the call's head is written, the call with its arguments cut short (as
    OpenAI sends one, and as clients such as LangChain read it: an invalid call), the
    same whole and streamed."""
    seen_partial = False
    for max_tokens in (6, 30, 40, 48):
        options: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                   "tool_choice": "required", "max_tokens": max_tokens,
                                   "temperature": 0}
        whole = (await sdk.chat.completions.create(**options)).choices[0]
        got = await gathered(await sdk.chat.completions.create(**options, stream=True))
        assert whole.finish_reason == got.finish == "length"
        assert whole.message.content is None and got.content == ""
        whole_calls = {i: {"name": c.function.name, "arguments": c.function.arguments}
                       for i, c in enumerate(whole.message.tool_calls or [])}
        assert whole_calls == got.calls
        for call in got.calls.values():
            assert call["name"] in PARAMETERS and call["arguments"].startswith("{")
            seen_partial = True
    assert seen_partial  # some budget reached the arguments


async def test_auto_without_a_call_is_plain_text_and_history_is_served(
        sdk: openai.AsyncOpenAI) -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather",
                       "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]
    response = await sdk.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=16, temperature=0,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True})
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].message.content


async def test_the_tools_reach_the_prompt(torch_stack: Stack, tiny_dir: Path) -> None:
    plain = await torch_stack.post("/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1})
    with_tools = await torch_stack.post("/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "tools": TOOLS})
    assert plain[0] == with_tools[0] == 200
    extra = with_tools[1]["usage"]["prompt_tokens"] - plain[1]["usage"]["prompt_tokens"]
    assert extra > 50  # the tool list and its instructions


@pytest.mark.parametrize(("extra", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools"),
])
async def test_bad_tool_requests_get_400(torch_stack: Stack, extra: dict[str, Any],
                                         param: str) -> None:
    status, body = await torch_stack.post("/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "tools": TOOLS, **extra})
    assert status == 400 and body["error"]["param"] == param, body


# A Llama 3.1-style template: calls are JSON after `<|python_tag|>` (`llama3_json`).
LLAMA_TEMPLATE = (
    "{%- for message in messages %}<|{{ message.role }}|>{{ message.content or '' }}"
    "{%- if message.tool_calls %}<|python_tag|>{{ message.tool_calls[0].function | tojson }}"
    "{%- endif %}\n{% endfor %}{%- if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")


async def test_a_forced_llama3_json_call_streams_its_arguments(
        nats_url: str, tiny_dir: Path, tmp_path: Path) -> None:
    """The built-in model behind a Llama-style template: a forced call is written as
    `{"name": ..., "parameters": {...}}` and streams as it is written, as a Hermes call
    does (before, it came whole in the last chunk)."""
    model_dir = tmp_path / "llama-style"
    shutil.copytree(tiny_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": LLAMA_TEMPLATE}))
    async with torch_stack_on("disaggregated", nats_url, str(model_dir), num_blocks=1536,
                              ) as stack, openai.AsyncOpenAI(
            base_url=stack.base_url, api_key="x", max_retries=0, timeout=120) as client:
        for seed in range(3):
            stream = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                max_tokens=128, temperature=1.0, seed=seed, stream=True)
            got = await gathered(stream)
            assert got.finish == "tool_calls" and got.content == "" and len(got.calls) == 1
            check_call(got.calls[0]["name"], got.calls[0]["arguments"], {"get_weather", "add"})
            assert got.num_pieces > 1  # as it was written, not whole at the end
