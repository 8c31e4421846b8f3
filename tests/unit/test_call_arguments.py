"""Hermes calls streamed as they are written: the id and name once the head is complete,
then the arguments piece by piece; what is not streamed comes whole at the end."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.call_arguments import CallArguments, CallStream, cut_calls
from services.gateway.tool_calls import ToolUse

USE = ToolUse("hermes", frozenset({"get_weather", "add"}), is_forced=False)
CALL = ('<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "O{s}lo \\" }", "n": [1, {"a": 2}]}}\n</tool_call>')


def fed(stream: CallArguments, text: str, piece_chars: int = 1) -> list[dict[str, Any]]:
    entries = []
    for at in range(0, len(text), piece_chars):
        entries += stream.feed(text[at:at + piece_chars])
    return entries


def calls_of(entries: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    """What a client accumulates from the entries, by call index."""
    calls: dict[int, dict[str, str]] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += entry.get("id", "")
        call["name"] += entry["function"].get("name", "")
        call["arguments"] += entry["function"]["arguments"]
    return calls


def test_a_call_streams_its_name_then_its_arguments_a_piece_at_a_time() -> None:
    stream = CallArguments(USE)
    entries = fed(stream, "Checking. " + CALL)
    opening = entries[0]
    assert opening["id"].startswith("call_") and opening["function"]["name"] == "get_weather"
    assert len(entries) > 10  # not held to the end
    (call,) = calls_of(entries).values()
    assert json.loads(call["arguments"]) == {"city": 'O{s}lo " }', "n": [1, {"a": 2}]}
    assert call["arguments"] == stream.calls[0].arguments
    _, parsed = USE.parse("Checking. " + CALL)
    assert stream.unsent(parsed) == []  # the parse finds the one already streamed


def test_parallel_calls_stream_under_their_own_indexes() -> None:
    second = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    calls = calls_of(fed(CallArguments(USE), CALL + "\n" + second, piece_chars=7))
    assert [c["name"] for c in calls.values()] == ["get_weather", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 2}


def test_only_the_first_call_streams_when_calls_are_not_parallel() -> None:
    use = ToolUse("hermes", USE.names, is_forced=False, is_parallel=False)
    text = CALL + '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    stream = CallArguments(use)
    assert list(calls_of(fed(stream, text))) == [0]
    assert stream.unsent(use.parse(text)[1]) == []


def test_a_call_to_a_tool_not_offered_is_not_streamed() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert fed(CallArguments(USE), text) == []


def test_a_call_in_another_shape_comes_whole_at_the_end() -> None:
    text = '<tool_call>{"arguments": {"a": 1, "b": 2}, "name": "add"}</tool_call>'
    stream = CallArguments(USE)
    assert fed(stream, text, piece_chars=5) == []
    (entry,) = stream.unsent(USE.parse(text)[1])
    assert entry["index"] == 0 and entry["function"]["name"] == "add"
    assert json.loads(entry["function"]["arguments"]) == {"a": 1, "b": 2}


def test_arguments_that_are_not_an_object_are_not_streamed() -> None:
    text = '<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>'
    assert fed(CallArguments(USE), text) == []


def test_a_chunk_holding_a_whole_call_sends_it_as_one_entry() -> None:
    (entry,) = CallArguments(USE).feed(CALL)
    assert entry["function"]["name"] == "get_weather"
    assert json.loads(entry["function"]["arguments"])["n"] == [1, {"a": 2}]


def test_a_marker_split_across_chunks_is_still_found() -> None:
    stream = CallArguments(USE)
    text = "x" * 300 + CALL
    assert calls_of(fed(stream, text, piece_chars=3))[0]["name"] == "get_weather"
    assert calls_of(fed(CallArguments(USE), text, piece_chars=1))[0]["name"] == "get_weather"


LLAMA = ToolUse("llama3_json", frozenset({"get_weather", "add"}), is_forced=False)
LLAMA_CALLS = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
               '{"name": "add", "parameters": {"a": 1, "b": {"c": [2]}}}')


def test_llama3_json_calls_stream_from_the_start_of_the_output() -> None:
    """Llama 3.1/3.2's JSON calls (after `<|python_tag|>`, `;` between them) stream as
    Hermes calls do, each under its index; the parse at the end finds no call unsent."""
    stream = CallArguments(LLAMA)
    entries = fed(stream, LLAMA_CALLS, piece_chars=3)
    assert len(entries) > 10
    calls = calls_of(entries)
    assert [c["name"] for c in calls.values()] == ["get_weather", "add"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        {"city": "Oslo"}, {"a": 1, "b": {"c": [2]}}]
    content, parsed = LLAMA.parse(LLAMA_CALLS)
    assert content == "" and stream.unsent(parsed) == []


def test_llama3_json_without_the_tag_and_with_arguments_as_the_key_streams_too() -> None:
    text = '\n {"name": "add", "arguments": {"a": 1}}'
    calls = calls_of(fed(CallArguments(LLAMA), text))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("add", {"a": 1})]


def test_llama3_json_text_that_is_not_a_call_streams_no_call() -> None:
    for text in ('Sure: {"name": "add", "parameters": {"a": 1}}',  # text before it
                 '{"answer": 42}',  # an object, not a call
                 '<|python_tag|>print("hi")'):  # code, not JSON
        stream = CallArguments(LLAMA)
        assert fed(stream, text) == [] and stream.calls == []


def test_a_llama3_json_call_to_a_tool_not_offered_stops_the_streaming() -> None:
    text = ('{"name": "delete_all", "parameters": {}}; '
            '{"name": "add", "parameters": {"a": 1}}')
    stream = CallArguments(LLAMA)
    assert fed(stream, text) == []  # the parse at the end decides what the output is
    assert [entry["function"]["name"] for entry in stream.unsent(LLAMA.parse(text)[1])] == [
        "add"]


def test_a_call_cut_short_is_the_call_as_far_as_it_went_never_text() -> None:
    """max_tokens ends the output inside a call: its markup is not content; the call goes
    out with its arguments cut short once its head was complete (as OpenAI's does)."""
    forced = ToolUse("hermes", USE.names, is_forced=True)
    for use in (USE, forced):
        stream = CallStream(use)
        sent, _ = stream.push('<tool_call>{"name": "add", "arguments": {"a": 1')
        rest, unsent = stream.finish(is_cut=True)
        assert (sent, rest, unsent) == ("", "", [])
        assert [(c.name, c.arguments) for c in stream.streamed_calls] == [("add", '{"a": 1')]
    content, calls = cut_calls(USE, 'Sure.<tool_call>{"name": "add", "arguments": {"a"')
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("add", '{"a"')]
    head_only = '<tool_call>{"name": "ad'
    assert cut_calls(forced, head_only) == ("", [])  # forced: a call, never text
    assert cut_calls(USE, head_only) == (head_only, [])  # auto: it may not have been one
