"""The Responses API without a stack: a request becomes the chat request it means, and a
response's chunks become its stream events and its whole object."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from services.gateway.generation import TextChunk
from services.gateway.openai_schema import FunctionName, NamedToolChoice, decode_body
from services.gateway.response_events import ResponseState, settings_of
from services.gateway.responses import TokenText
from services.gateway.responses_api import InputItem, ResponsesRequest, chat_request
from services.gateway.tokenizer import ByteTokenizer
from services.gateway.tool_calls import ToolUse
from services.gateway.validation import ParsedRequest
from shared.errors import InvalidRequest, UnsupportedParameter
from shared.messages import SamplingParams, TokenLogprob


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest(**{"model": "m", "input": "hi", **fields})


def decoded(body: bytes) -> ResponsesRequest:
    return decode_body(body, ResponsesRequest)


def test_a_continued_conversation_comes_before_the_new_input() -> None:
    history = [InputItem(role="user", content="hi"),
               InputItem(type="function_call", call_id="c1", name="f", arguments="{}")]
    chat = chat_request(request(instructions="be brief", input=[
        InputItem(type="function_call_output", call_id="c1", output="done")]), history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", None), ("tool", "done")]
    assert chat.messages[2].tool_calls is not None


def test_instructions_and_input_become_chat_turns() -> None:
    chat = chat_request(decoded(
        b'{"model": "m", "instructions": "be brief", "max_output_tokens": 7, "input": ['
        b'{"role": "user", "content": "hi"},'
        b'{"type": "message", "role": "assistant", "content": [{"type": "output_text", '
        b'"text": "hel", "annotations": []}, {"type": "output_text", "text": "lo"}]},'
        b'{"role": "developer", "content": [{"type": "input_text", "text": "go"}]}]}'))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("developer", "go")]
    assert chat.max_completion_tokens == 7


def test_function_calls_in_a_row_become_one_assistant_turn() -> None:
    chat = chat_request(decoded(
        b'{"model": "m", "input": [{"role": "user", "content": "w"},'
        b'{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}",'
        b' "id": "fc_1", "status": "completed"},'
        b'{"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\\"a\\": 1}"},'
        b'{"type": "function_call_output", "call_id": "c1", "output": "one"},'
        b'{"type": "function_call_output", "call_id": "c2", "output": "two"}]}'))
    user, assistant, first, second = chat.messages
    assert user.role == "user" and assistant.role == "assistant" and assistant.content is None
    assert [(c.id, c.function.name) for c in assistant.tool_calls or []] == [
        ("c1", "f"), ("c2", "g")]
    assert (first.role, first.tool_call_id, first.content) == ("tool", "c1", "one")
    assert (second.tool_call_id, second.content) == ("c2", "two")


def test_function_tools_and_a_named_choice_become_chat_tools() -> None:
    chat = chat_request(decoded(
        b'{"model": "m", "input": "w", "tools": [{"type": "function", "name": "f",'
        b' "parameters": {"type": "object"}, "strict": true}],'
        b' "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": false}'))
    assert chat.tools is not None and chat.tools[0].function.name == "f"
    assert chat.tool_choice == NamedToolChoice(type="function",
                                               function=FunctionName(name="f"))
    assert chat.parallel_tool_calls is False


def test_text_format_json_schema_becomes_response_format() -> None:
    chat = chat_request(decoded(
        b'{"model": "m", "input": "w", "text": {"format": {"type": "json_schema",'
        b' "name": "n", "schema": {"type": "object"}, "strict": true}}}'))
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.type == "json_schema"
    assert chat.response_format.json_schema.schema_ == {"type": "object"}


def test_every_field_of_the_api_may_be_sent_unset() -> None:
    """Clients that send each field they know, null where they set none."""
    fields = ["instructions", "max_output_tokens", "temperature", "top_p", "top_logprobs",
              "include", "stream", "stream_options", "tools", "tool_choice",
              "parallel_tool_calls", "text", "reasoning", "truncation", "previous_response_id",
              "conversation", "background", "prompt", "max_tool_calls", "store", "metadata",
              "user", "service_tier", "prompt_cache_key", "safety_identifier", "priority"]
    body = msgspec.json.encode({"model": "m", "input": "hi", **dict.fromkeys(fields)})
    assert chat_request(decoded(body)).messages[-1].content == "hi"
    assert chat_request(decoded(b'{"model": "m", "input": "hi", "max_tool_calls": 3}'))
    assert chat_request(decoded(b'{"model": "m", "input": "hi", "priority": -2}')).priority == -2


def test_logprobs_are_asked_by_include_or_top_logprobs() -> None:
    assert chat_request(request(include=["message.output_text.logprobs"])).logprobs
    assert chat_request(request(top_logprobs=3)).top_logprobs == 3
    assert chat_request(request()).logprobs is None


@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"conversation": "conv_1"}, UnsupportedParameter, "`conversation`"),
    ({"background": True}, UnsupportedParameter, "`background`"),
    ({"prompt": {"id": "pmpt_1"}}, UnsupportedParameter, "`prompt`"),
    ({"max_tool_calls": -1}, InvalidRequest, "max_tool_calls"),
    ({"include": ["file_search_call.results"]}, UnsupportedParameter, "include"),
    ({"truncation": "auto"}, UnsupportedParameter, "truncation"),
    ({"top_logprobs": 21}, InvalidRequest, "top_logprobs"),
    ({"input": []}, InvalidRequest, "input must not be empty"),
    ({"tool_choice": {"type": "function"}}, InvalidRequest, "needs the function's name"),
    ({"tool_choice": {"type": "allowed_tools"}}, UnsupportedParameter, "'allowed_tools'"),
    ({"text": {"format": {"type": "yaml"}}}, InvalidRequest, "text.format.type 'yaml'"),
])
def test_what_is_not_served_is_refused(fields: dict[str, Any], error: type[Exception],
                                       message: str) -> None:
    body = msgspec.json.encode({"model": "m", "input": "hi", **fields})
    with pytest.raises(error, match=message):
        chat_request(decoded(body))


@pytest.mark.parametrize(("body", "message"), [
    (b'{"type": "reasoning", "id": "rs_1", "summary": []}', "item type 'reasoning'"),
    (b'{"type": "function_call", "name": "f", "arguments": "{}"}', "needs call_id"),
    (b'{"type": "function_call_output", "call_id": "c"}', "needs call_id and output"),
    (b'{"role": "tool", "content": "x"}', "role 'tool'"),
    (b'{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}',
     "only text parts"),
    (b'{"role": "user", "content": [{"type": "input_text"}]}', "a text part needs its text"),
])
def test_a_bad_input_item_names_its_place(body: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as info:
        chat_request(decoded(b'{"model": "m", "input": [' + body + b"]}"))
    assert info.value.param == "input" and "input[0]" in info.value.message


def state(tools: ToolUse | None = None, *, wants_logprobs: bool = False) -> ResponseState:
    parsed = ParsedRequest(model="m", prompt_token_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=4), stop=[], is_stream=True,
                           include_usage=False, tools=tools)
    return ResponseState("resp_1", "m", settings_of(request()), TokenText(ByteTokenizer()),
                         parsed, wants_logprobs=wants_logprobs)


def chunk(text: str, count: int, finish: Any = None, **fields: Any) -> TextChunk:
    return TextChunk(text=text, finish_reason=finish, num_completion_tokens=count, **fields)


def test_chunks_become_text_events_then_the_closing_ones() -> None:
    response = state()
    events = response.opening() + response.add(chunk("he", 2)) + response.add(
        chunk("y", 3, "stop"))
    assert response.is_done
    events.append(response.finished())
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    body = events[-1]["response"]
    assert body == response.body() and body["status"] == "completed"
    assert body["output"][0]["content"][0]["text"] == "hey"
    assert body["usage"] == {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 6}


def test_a_response_cut_by_its_token_limit_is_incomplete() -> None:
    response = state()
    response.add(chunk("abcd", 4, "length"))
    assert response.finished()["type"] == "response.incomplete"
    body = response.body()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


def test_an_empty_answer_is_still_one_empty_message() -> None:
    response = state()
    response.add(chunk("", 1, "stop"))
    assert [item["type"] for item in response.body()["output"]] == ["message"]
    assert response.body()["output"][0]["content"][0]["text"] == ""


def test_a_call_in_the_output_becomes_a_function_call_item() -> None:
    response = state(ToolUse("hermes", frozenset({"f"}), is_forced=False))
    events = response.add(chunk("ok <tool_", 3)) + response.add(
        chunk('call>{"name": "f", "arguments": {"a": 1}}</tool_call>', 9, "stop"))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == "ok "
    message, call = response.body()["output"]
    assert message["content"][0]["text"] == "ok "
    assert (call["type"], call["name"], call["arguments"]) == ("function_call", "f", '{"a": 1}')
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["output_index"] == 1 and done["arguments"] == '{"a": 1}'


def test_logprobs_follow_the_text_they_belong_to() -> None:
    response = state(wants_logprobs=True)
    events = response.add(chunk("a", 1, token_ids=[97],
                                logprobs=[TokenLogprob(-0.5, [(97, -0.5), (98, -1.0)])]))
    delta = events[-1]
    assert delta["logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97],
                                  "top_logprobs": [
                                      {"token": "a", "logprob": -0.5, "bytes": [97]},
                                      {"token": "b", "logprob": -1.0, "bytes": [98]}]}]
    response.add(chunk("", 1, "stop"))
    assert response.body()["output"][0]["content"][0]["logprobs"] == delta["logprobs"]


def test_an_error_after_the_start_fails_the_response() -> None:
    response = state()
    response.add(chunk("a", 1))
    (event,) = response.failed(InvalidRequest("boom"))
    assert event["type"] == "response.failed"
    assert event["response"]["status"] == "failed"
    assert event["response"]["error"]["message"] == "boom"


def test_a_call_streams_as_it_is_written_beside_the_message() -> None:
    response = state(ToolUse("hermes", frozenset({"add"}), is_forced=False))
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}}</tool_call>'
    before_end = [event for char in text for event in response.add(chunk(char, 1))]
    kinds = [e["type"] for e in before_end]
    assert "response.output_item.added" in kinds  # the call's item, before the end
    added = [e for e in before_end if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"), (1, "function_call")]
    pieces = [e["delta"] for e in before_end
              if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == '{"a": 12, "b": 3}'
    closing = response.add(chunk("", 60, "stop"))
    done = next(e for e in closing if e["type"] == "response.function_call_arguments.done")
    assert (done["output_index"], done["arguments"]) == (1, '{"a": 12, "b": 3}')
    message, call = response.body()["output"]
    assert message["content"][0]["text"] == "Sure. " and call["status"] == "completed"
