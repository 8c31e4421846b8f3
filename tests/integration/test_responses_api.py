"""The Responses API (`/v1/responses`) through the `openai` SDK against a real stack on the
torch engine: the answer is the chat answer to the same conversation, streamed events build
the same response, logprobs, function calls and their results, JSON schema outputs, stored
responses continued by id (through another gateway too), retrieved and deleted, and 400s for
what is not served."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import openai
import pytest

from services.gateway.service import GatewayService
from tests.stack import Stack, eventually

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
INSTRUCTIONS = "Answer in one line."
TURNS: list[Any] = [
    {"role": "user", "content": "Where does the half moon rise?"},
    {"role": "assistant", "content": "Over the harbour."},
    {"role": "user", "content": [{"type": "input_text", "text": "And when?"}]},
]
CHAT_TURNS = [{"role": "system", "content": INSTRUCTIONS}, *TURNS[:2],
              {"role": "user", "content": "And when?"}]
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"]}}


async def test_a_response_is_the_chat_answer_to_the_same_conversation(
        sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model=MODEL, instructions=INSTRUCTIONS, input=TURNS,
                                          max_output_tokens=8, temperature=0)
    chat = await sdk.chat.completions.create(model=MODEL, messages=CHAT_TURNS, max_tokens=8,
                                             temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    assert chat.usage is not None and response.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    is_cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if is_cut else "completed")
    if is_cut:
        assert response.incomplete_details is not None
        assert response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == INSTRUCTIONS and response.store is True


async def test_streamed_events_build_the_same_response(sdk: openai.AsyncOpenAI) -> None:
    whole = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=8,
                                       temperature=0)
    stream = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=8,
                                        temperature=0, stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text == whole.output_text
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == whole.usage.output_tokens  # type: ignore[union-attr]


async def test_logprobs_come_with_the_text_when_included(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=5,
                                          temperature=0, top_logprobs=2,
                                          include=["message.output_text.logprobs"])
    chat = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    text = response.output[0].content[0]  # type: ignore[union-attr]
    expected = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert text.logprobs is not None and expected is not None
    assert [e.token for e in text.logprobs] == [e.token for e in expected]
    assert [e.logprob for e in text.logprobs] == pytest.approx([e.logprob for e in expected])
    assert all(len(e.top_logprobs) == 2 for e in text.logprobs)


async def test_a_forced_function_call_and_then_its_result(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model=MODEL, input="Weather in Oslo?",
                                          tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
                                          max_output_tokens=128, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[union-attr]

    history: list[Any] = [{"role": "user", "content": "Weather in Oslo?"},
                          call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id,  # type: ignore[union-attr]
                           "output": "sunny, 21 C"}]
    answer = await sdk.responses.create(model=MODEL, input=history, tools=[WEATHER],  # type: ignore[list-item]
                                        tool_choice="none", max_output_tokens=6)
    assert answer.output[0].type == "message" and answer.output_text


async def test_a_streamed_function_call_arrives_as_it_is_written(
        sdk: openai.AsyncOpenAI) -> None:
    async with sdk.responses.stream(
            model=MODEL, input="Weather?", tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=128, temperature=0) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.done" in kinds
    assert kinds.count("response.function_call_arguments.delta") > 1
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


async def test_a_function_call_cut_short_is_an_incomplete_call_never_text(
        sdk: openai.AsyncOpenAI) -> None:
    cut = []
    for max_output_tokens in (6, 38, 48):
        response = await sdk.responses.create(
            model=MODEL, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",  # type: ignore[list-item]
            max_output_tokens=max_output_tokens, temperature=0)
        assert response.status == "incomplete"
        assert "<tool_call>" not in response.output_text
        calls = [item for item in response.output if item.type == "function_call"]
        assert all(call.status == "incomplete" for call in calls)  # type: ignore[union-attr]
        cut.append((response, calls))
    assert calls and calls[0].arguments.startswith("{")  # type: ignore[union-attr]
    # The conversation goes on from a call cut mid-arguments (not JSON), as a client
    # answering it does.
    response, calls = cut[1]
    assert calls and calls[0].arguments.startswith("{")  # type: ignore[union-attr]
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0].arguments)  # type: ignore[union-attr]
    answer = await sdk.responses.create(
        model=MODEL, previous_response_id=response.id, tools=[WEATHER],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,  # type: ignore[union-attr]
                "output": "sunny"}], tool_choice="none", max_output_tokens=4)
    assert answer.output[0].type == "message" and answer.output_text


async def test_a_json_schema_output_keeps_to_the_schema(sdk: openai.AsyncOpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    response = await sdk.responses.create(
        model=MODEL, input="a number", max_output_tokens=64, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text is not None and response.text.format.type == "json_schema"  # type: ignore[union-attr]


@pytest.mark.parametrize(("fields", "message"), [
    ({"previous_response_id": "resp_1"}, "Previous response with id 'resp_1' not found"),
    ({"conversation": "conv_1"}, "`conversation`"),
    ({"tools": [{"type": "web_search"}]}, "tool type 'web_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "only text parts"),
    ({"reasoning": {"effort": "high"}}, "`reasoning`"),
    ({"prompt": {"id": "pmpt_1"}}, "does not support `prompt`"),
])
async def test_what_is_not_served_is_refused_with_400(sdk: openai.AsyncOpenAI,
                                                      fields: dict[str, Any],
                                                      message: str) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        await sdk.post("/responses", body=body, cast_to=dict)


async def test_a_continued_response_answers_the_whole_conversation(
        sdk: openai.AsyncOpenAI) -> None:
    first = await sdk.responses.create(model=MODEL, input=TURNS[:1], max_output_tokens=6,
                                       temperature=0)
    second = await sdk.responses.create(model=MODEL, previous_response_id=first.id,
                                        input="And when?", max_output_tokens=6, temperature=0)
    whole = await sdk.responses.create(model=MODEL, input=[
        TURNS[0], {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And when?"}], max_output_tokens=6, temperature=0)
    assert second.previous_response_id == first.id
    assert second.output_text == whole.output_text
    assert second.usage is not None and whole.usage is not None
    assert second.usage.input_tokens == whole.usage.input_tokens


async def test_a_stored_response_is_retrieved_listed_and_deleted(
        sdk: openai.AsyncOpenAI) -> None:
    created = await sdk.responses.create(model=MODEL, input=TURNS, max_output_tokens=4,
                                         stream=False)
    fetched = await sdk.responses.retrieve(created.id)
    assert fetched.model_dump() == created.model_dump()
    items = await sdk.responses.input_items.list(created.id)
    assert [(item.type, item.role) for item in items.data] == [  # type: ignore[union-attr]
        ("message", "user"), ("message", "assistant"), ("message", "user")]
    await sdk.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError, match=created.id):
        await sdk.responses.retrieve(created.id)


async def test_a_streamed_response_is_stored_before_its_last_event(
        sdk: openai.AsyncOpenAI) -> None:
    stream = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4,
                                        stream=True)
    async for event in stream:
        if event.type in ("response.completed", "response.incomplete"):
            break  # the stream is still open: the response is stored already
    final = event.response  # type: ignore[union-attr]
    fetched = await sdk.responses.retrieve(final.id)
    assert fetched.output_text == final.output_text and final.store is True
    await stream.close()


async def test_store_false_keeps_nothing(sdk: openai.AsyncOpenAI) -> None:
    response = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                          store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        await sdk.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.responses.create(model=MODEL, input="more", max_output_tokens=2,
                                   previous_response_id=response.id)
    assert info.value.code == "previous_response_not_found"


async def test_another_gateway_continues_a_stored_response(
        module_stack: Stack, sdk: openai.AsyncOpenAI) -> None:
    """Stored in NATS, not in the gateway: any gateway of the cluster continues it."""
    first = await sdk.responses.create(model=MODEL, input="hi", max_output_tokens=3,
                                       temperature=0)
    other = GatewayService(msgspec.structs.replace(module_stack.gateway.config,
                                                   gateway_id=None))
    await other.start()
    try:
        async with openai.AsyncOpenAI(base_url=f"{other.url}/v1", api_key="x",
                                      max_retries=0) as client:
            await eventually(lambda: other.health()["status"] == "ok")
            second = await client.responses.create(model=MODEL, input="more",
                                                   previous_response_id=first.id,
                                                   max_output_tokens=3)
            assert (await client.responses.retrieve(second.id)).previous_response_id == \
                first.id
    finally:
        await other.stop()
