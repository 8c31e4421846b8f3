"""The OpenAI features through the synchronous `openai` SDK against `halfmoon up` on the
torch engine, every service its own process, disaggregated and colocated: logprobs, echo
with prompt logprobs, token-id prompts, n > 1, structured outputs, a forced tool call, and
a 400 that leaves the stack serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.integration.test_cli import free_port, wait_for_line

pytestmark = pytest.mark.e2e

SETUPS = {"disaggregated": ["--prefill", "1", "--decode", "1"],
          "colocated": ["--mode", "colocated", "--workers", "1"]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"]}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string", "maxLength": 8}},
    "required": ["key"]}}}


@pytest.fixture(scope="module", params=list(SETUPS))
def client(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[openai.OpenAI]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--model",
         str(tiny_dir), *SETUPS[request.param]],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_for_line(process, "halfmoon is up", timeout_s=90)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           max_retries=0, timeout=120) as sdk:
            yield sdk
    finally:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)


def test_every_feature_through_the_sync_sdk(client: openai.OpenAI, tiny_dir: Path) -> None:
    model = tiny_dir.name
    messages = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                           temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    streamed = [entry for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True,  # type: ignore[arg-type]
        top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
        for choice in chunk.choices if choice.logprobs
        for entry in choice.logprobs.content or []]
    assert [e.token for e in streamed] == [e.token for e in content]

    scored = client.completions.create(model=model, prompt=[[1, 40, 41, 42], [1, 50, 51]],
                                       max_tokens=0, echo=True, logprobs=1)
    assert [c.index for c in scored.choices] == [0, 1]
    for choice, length in zip(scored.choices, (4, 3), strict=True):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        assert len(choice.logprobs.token_logprobs) == length
        assert choice.logprobs.token_logprobs[0] is None
        assert all(v is not None and v <= 0 for v in choice.logprobs.token_logprobs[1:])

    several = client.completions.create(model=model, prompt="Once", max_tokens=6, n=3,
                                        temperature=1.0, seed=4,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.usage is not None and several.usage.completion_tokens == 18

    shaped = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=1.0, seed=2,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "thing", "schema": SCHEMA}})
    jsonschema.validate(json.loads(shaped.choices[0].message.content or ""), SCHEMA)

    called = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, tools=[TOOL], tool_choice="required",  # type: ignore[arg-type, list-item]
        temperature=1.0, seed=3)
    (call,) = called.choices[0].message.tool_calls or []
    assert called.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments),  # type: ignore[union-attr]
                        TOOL["function"]["parameters"])  # type: ignore[index]

    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="x", extra_body={"frobnicate": 1})
    assert refused.value.body["param"] == "frobnicate"  # type: ignore[index]
    assert client.completions.create(model=model, prompt="x", max_tokens=2).choices
