"""Structured outputs through the `openai` SDK on the built-in model, whose weights are
random: every output still parses as JSON and validates against its schema (grammar-
constrained decoding on prefill's first token and every decode step), streamed and not,
disaggregated and colocated."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import openai
import pytest

from shared.errors import ErrorCode
from shared.messages import GenerateRequest, GrammarSpec, RequestFailed, SamplingParams
from shared.nats_client import encode
from tests.stack import PATHS, torch_stack_on

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"}}, "required": ["name", "age", "admin"]},
    "story": {"type": "object", "properties": {  # unbounded strings and array
        "title": {"type": "string"},
        "lines": {"type": "array", "items": {"type": "string"}}},
        "required": ["title", "lines"]},
    "choice": {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                   "maxItems": 3},
        "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]}},
        "required": ["colour", "scores", "note"]},
    "nested": {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
        "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"}}},
        "required": ["path"]},
}
NUM_REQUESTS = 50


@pytest.fixture(params=PATHS)
async def sdk(request: pytest.FixtureRequest, nats_url: str, tiny_dir: Path
              ) -> AsyncIterator[openai.AsyncOpenAI]:
    async with torch_stack_on(request.param, nats_url, str(tiny_dir), num_blocks=1024,
                              max_batch_size=64) as stack, openai.AsyncOpenAI(
            base_url=stack.base_url, api_key="x", max_retries=0, timeout=120) as client:
        yield client


async def ask(sdk: openai.AsyncOpenAI, schema: dict[str, Any] | None, seed: int,
              *, stream: bool) -> str:
    response_format: dict[str, Any] = (
        {"type": "json_object"} if schema is None else
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                "strict": True}})
    options: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": f"JSON please #{seed}"}],
        "max_tokens": 96, "temperature": 1.0, "seed": seed,
        "response_format": response_format}
    if not stream:
        response = await sdk.chat.completions.create(**options)
        assert response.choices[0].finish_reason == "stop"
        return response.choices[0].message.content or ""
    chunks = await sdk.chat.completions.create(stream=True, **options)
    texts, finish = [], None
    async for chunk in chunks:
        for choice in chunk.choices:
            texts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    return "".join(texts)


@pytest.mark.parametrize("name", [*SCHEMAS, "json_object"])
async def test_every_output_is_json_that_validates(sdk: openai.AsyncOpenAI, name: str) -> None:
    schema = SCHEMAS.get(name)
    outputs = await asyncio.gather(*(ask(sdk, schema, seed, stream=seed % 2 == 1)
                                     for seed in range(NUM_REQUESTS)))
    for output in outputs:
        value = json.loads(output)
        if schema is None:
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, schema)
    assert len(set(outputs)) > 1  # sampled, not one canned answer


async def test_completions_take_response_format_too(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.completions.create(
        model=MODEL, prompt="A person:", max_tokens=96, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": SCHEMAS["person"]}}})
    jsonschema.validate(json.loads(response.choices[0].text), SCHEMAS["person"])


CHOICES = ["yes", "no", "not \"sure\""]
GUIDED = [  # vLLM's fields, and what every output must then be
    pytest.param({"guided_choice": CHOICES}, CHOICES.__contains__, id="guided_choice"),
    pytest.param({"structured_outputs": {"choice": CHOICES}}, CHOICES.__contains__,
                 id="structured_outputs.choice"),
    pytest.param({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"},
                 re.compile(r"[0-9]{3}-[a-z]{2,4}").fullmatch, id="guided_regex"),
    pytest.param({"structured_outputs": {"regex": r"(ab)+c?"}},
                 re.compile(r"(ab)+c?").fullmatch, id="structured_outputs.regex"),
    pytest.param({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}},
                 re.compile(r"x[0-9][0-9]?").fullmatch, id="structured_outputs.grammar"),
    pytest.param({"guided_json": SCHEMAS["person"]},
                 lambda text: jsonschema.validate(json.loads(text), SCHEMAS["person"]) is None,
                 id="guided_json"),
]


@pytest.mark.parametrize(("fields", "is_valid"), GUIDED)
async def test_vllms_structured_output_fields_hold_every_output(
        sdk: openai.AsyncOpenAI, fields: dict[str, Any], is_valid: Any) -> None:
    async def one(seed: int) -> str:
        options: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "temperature": 1.0,
                                   "seed": seed, "extra_body": fields}
        if seed % 2:
            response = await sdk.completions.create(prompt=f"#{seed}", **options)
            return response.choices[0].text
        chat = await sdk.chat.completions.create(
            messages=[{"role": "user", "content": f"#{seed}"}], **options)
        assert chat.choices[0].finish_reason == "stop"
        return chat.choices[0].message.content or ""

    outputs = await asyncio.gather(*(one(seed) for seed in range(12)))
    assert all(is_valid(output) for output in outputs), outputs


@pytest.mark.parametrize("path", PATHS)
async def test_a_grammar_slower_to_compile_than_the_dispatch_wait_still_serves(
        path: str, nats_url: str, tiny_dir: Path) -> None:
    """The decode worker answers a reservation at once and readies the grammar meanwhile:
    the conductor waits `dispatch_timeout_s` on the answer, and a first compile takes
    seconds on a busy machine (here it is held for longer than that wait)."""
    async with torch_stack_on(path, nats_url, str(tiny_dir),
                              conductor={"dispatch_timeout_s": 0.3}) as stack, \
            openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0,
                               timeout=60) as client:
        engine = stack.decodes[0].engine
        prepare = engine.prepare

        async def slow_prepare(sampling: Any) -> None:
            await asyncio.sleep(1.0)
            await prepare(sampling)

        engine.prepare = slow_prepare  # type: ignore[method-assign]
        outputs = await asyncio.gather(*(ask(client, SCHEMAS["person"], seed, stream=seed == 0)
                                         for seed in range(3)))
    for output in outputs:
        jsonschema.validate(json.loads(output), SCHEMAS["person"])


@pytest.mark.parametrize("path", PATHS)
async def test_a_grammar_that_cannot_compile_fails_its_request_and_frees_it(
        path: str, nats_url: str, tiny_dir: Path) -> None:
    """A custom NATS client may send any EBNF: one that does not compile is an invalid
    request for its sender, and every block it held is free again."""
    async with torch_stack_on(path, nats_url, str(tiny_dir)) as stack:
        nc = stack.gateway.nc
        inbox = nc.new_inbox()
        replies = await nc.subscribe(inbox)
        request = GenerateRequest(
            request_id="bad-grammar", model=MODEL, prompt_token_ids=[1, 2, 3],
            sampling=SamplingParams(max_tokens=8, grammar=GrammarSpec(
                kind="ebnf", source='root ::= "a" nope')),
            reply_subject=inbox, created_at_s=time.time())
        await nc.jetstream().publish(stack.gateway.subjects.requests, encode(request),
                                     headers={"Nats-Msg-Id": request.request_id})
        while msgspec.json.decode((reply := await replies.next_msg(timeout=30)).data)[
                "type"] != "RequestFailed":
            pass  # the placement comes first
        failure = msgspec.json.decode(reply.data, type=RequestFailed)
        assert failure.code == ErrorCode.INVALID_REQUEST
        assert "not defined" in failure.message
        await stack.wait_blocks_free()
