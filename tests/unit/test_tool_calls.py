"""Tool calls: the two formats' parsers, the streaming hold-back, and the request checks."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_schema import (
    ChatCompletionRequest,
    chat_messages,
    chat_tools,
    decode_body,
    forced_tool_grammar,
)
from services.gateway.tool_calls import ToolCallStream, ToolUse, tool_format
from shared.errors import InvalidRequest, UnsupportedParameter

HERMES = ToolUse("hermes", frozenset({"get_weather", "add"}), is_forced=False)
LLAMA = ToolUse("llama3_json", frozenset({"get_weather"}), is_forced=False)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_hermes_calls_are_found_with_the_text_around_them() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    single = ToolUse("hermes", HERMES.names, is_forced=False, is_parallel=False)
    assert len(single.parse(text)[1]) == 1


def test_unknown_functions_and_broken_json_stay_text() -> None:
    for text in ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "add", "arguments": </tool_call>', "just words"):
        assert HERMES.parse(text) == (text, [])


def test_llama3_json_calls() -> None:
    content, calls = LLAMA.parse('<|python_tag|>{"name": "get_weather", '
                                 '"parameters": {"city": "Rome"}}')
    assert content == "" and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert LLAMA.parse("The weather is fine.") == ("The weather is fine.", [])


def test_templates_say_their_format() -> None:
    assert tool_format("... <tool_call> ...") == "hermes"
    assert tool_format("{{ '<|python_tag|>' }} ipython") == "llama3_json"


def test_streaming_holds_back_only_what_may_be_a_call() -> None:
    stream = ToolCallStream(HERMES)
    pieces = ["Hello ", "there <tool", "_ca", 'll>{"name": "add", ', '"arguments": {"a": 2}}',
              "</tool_call>"]
    sent = "".join(stream.push(p) for p in pieces)
    assert sent == "Hello there "
    content, calls = stream.finish()
    assert content == "" and calls[0].name == "add"
    false_alarm = ToolCallStream(HERMES)
    assert false_alarm.push("a <tool") == "a "
    assert false_alarm.push("box> b") == "<toolbox> b"


def request(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_body(json.dumps(body).encode(), ChatCompletionRequest)


def test_tool_choice_decides_whether_the_output_is_forced() -> None:
    rendered, use = chat_tools(request(tools=[WEATHER]), "hermes", template_has_tools=True)
    assert rendered == [WEATHER] and use is not None and not use.is_forced
    assert forced_tool_grammar(request(tools=[WEATHER]), use) is None
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        forced = request(tools=[WEATHER], tool_choice=choice)
        _, use = chat_tools(forced, "hermes", template_has_tools=True)
        assert use is not None and use.is_forced
        grammar = forced_tool_grammar(forced, use)
        assert grammar is not None and grammar.begin == "<tool_call>"
        assert json.loads(grammar.source)["properties"]["arguments"] == \
            WEATHER["function"]["parameters"]  # type: ignore[index]
    assert chat_tools(request(tools=[WEATHER], tool_choice="none"), "hermes",
                      template_has_tools=True)[1] is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
])
def test_bad_tool_requests_are_refused(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        chat_tools(request(**fields), "hermes", template_has_tools=True)
    assert info.value.param == param


def test_a_template_without_tools_refuses_them() -> None:
    with pytest.raises(UnsupportedParameter):
        chat_tools(request(tools=[WEATHER]), "hermes", template_has_tools=False)


def test_history_with_calls_and_results_is_rendered_with_object_arguments() -> None:
    history = request(messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}])
    turns = chat_messages(history)
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert turns[2]["tool_call_id"] == "call_1"
    with pytest.raises(InvalidRequest, match="tool_call_id"):
        chat_messages(request(messages=[{"role": "tool", "content": "x"}]))


def test_a_call_cut_short_is_replayed_with_its_text_as_it_is() -> None:
    """A forced call that `max_tokens` ended mid-arguments, sent back as history (as a
    Responses client continuing with `previous_response_id` does): rendered, not refused."""
    history = request(messages=[
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Os'}}]}])
    assert chat_messages(history)[1]["tool_calls"][0]["function"]["arguments"] == \
        '{"city": "Os'

