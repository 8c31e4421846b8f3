"""vLLM's structured-output fields as grammar specs, checked at the gateway."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.gateway.guided import StructuredOutputs
from services.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    chat_tools,
    decode_body,
)
from services.gateway.validation import chat_output, completion_output
from shared.errors import InvalidRequest, UnsupportedParameter
from shared.messages import GrammarSpec


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest(**{"model": "m", "prompt": "hi", **fields})


def test_guided_choice_is_a_grammar_of_its_strings_escaped() -> None:
    output = completion_output(completion(guided_choice=["yes", 'a "b"\\\n']))
    assert output.grammar == GrammarSpec(kind="ebnf", source='root ::= "yes" | "a \\"b\\"\\\\\\n"')
    assert output.grammar_param == "guided_choice"


@pytest.mark.parametrize(("fields", "spec", "param"), [
    ({"guided_regex": "[a-z]+"}, GrammarSpec(kind="regex", source="[a-z]+"), "guided_regex"),
    ({"guided_grammar": 'root ::= "x"'}, GrammarSpec(kind="ebnf", source='root ::= "x"'),
     "guided_grammar"),
    ({"guided_json": '{"type": "object"}'},
     GrammarSpec(kind="json_schema", source='{"type": "object"}'), "guided_json"),
    ({"structured_outputs": StructuredOutputs(json={"type": "integer"})},
     GrammarSpec(kind="json_schema", source=json.dumps({"type": "integer"})),
     "structured_outputs.json"),
    ({"structured_outputs": StructuredOutputs(json_object=True)},
     GrammarSpec(kind="json_object"), "structured_outputs.json_object"),
])
def test_each_field_becomes_its_grammar(fields: dict[str, Any], spec: GrammarSpec,
                                        param: str) -> None:
    output = completion_output(completion(**fields))
    assert (output.grammar, output.grammar_param) == (spec, param)


def test_json_object_false_asks_for_nothing() -> None:
    output = completion_output(completion(
        structured_outputs=StructuredOutputs(json_object=False)))
    assert output.grammar is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"guided_choice": ["a"], "guided_regex": "b"}, "one output constraint"),
    ({"guided_choice": ["a"], "response_format": ResponseFormat(type="json_object")},
     "response_format and guided_choice"),
    ({"structured_outputs": StructuredOutputs(regex="a", choice=["b"])},
     "one output constraint"),
    ({"guided_choice": []}, "1 to 1024 strings"),
    ({"guided_choice": ["a", ""]}, "must not be empty"),
    ({"guided_regex": ""}, "regex must not be empty"),
    ({"guided_json": "{nope"}, "not JSON text"),
    ({"guided_json": "[1]"}, "must be an object"),
])
def test_a_bad_constraint_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        completion_output(completion(**fields))


def test_a_forced_tool_call_takes_no_other_constraint() -> None:
    request = decode_body(
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "guided_regex": "a",'
        b' "tools": [{"type": "function", "function": {"name": "f"}}],'
        b' "tool_choice": "required"}', ChatCompletionRequest)
    _, use = chat_tools(request, "hermes", template_has_tools=True)
    with pytest.raises(InvalidRequest, match="forced tool call and guided_regex") as info:
        chat_output(request, use)
    assert info.value.param == "tool_choice"


def test_an_unknown_structured_outputs_field_is_refused() -> None:
    with pytest.raises(UnsupportedParameter, match=r"structured_outputs\.whitespace_pattern"):
        decode_body(b'{"model": "m", "prompt": "x", "structured_outputs": '
                    b'{"whitespace_pattern": " "}}', CompletionRequest)
