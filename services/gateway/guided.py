"""vLLM's structured-output extensions as grammar specs: `structured_outputs` (`json`,
`regex`, `choice`, `grammar`, `json_object`) and the older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` that many clients still send. One constraint per request:
these, or `response_format` (validation.py), not two."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from shared.errors import InvalidRequest
from shared.messages import GrammarSpec

MAX_CHOICES = 1024  # `choice` strings


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GuidedParams(msgspec.Struct, kw_only=True):
    """The request fields this module reads (mixed into the request schemas)."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: every output keeps to its grammar


def guided_grammar(request: GuidedParams) -> tuple[GrammarSpec, str] | None:
    """The grammar these fields ask for and the field that asked, or None."""
    asked = _asked(request)
    if len(asked) > 1:
        raise InvalidRequest(f"one output constraint per request, got {', '.join(asked)}",
                             param=next(iter(asked)))
    if not asked:
        return None
    ((param, (kind, value)),) = asked.items()
    return _spec(kind, value, param), param


def _asked(request: GuidedParams) -> dict[str, tuple[str, Any]]:
    """Every constraint set, by the name it was set under."""
    fields = {"guided_json": ("json", request.guided_json),
              "guided_regex": ("regex", request.guided_regex),
              "guided_choice": ("choice", request.guided_choice),
              "guided_grammar": ("grammar", request.guided_grammar)}
    if (outputs := request.structured_outputs) is not None:
        fields |= {f"structured_outputs.{kind}": (kind, getattr(outputs, kind))
                   for kind in ("json", "regex", "choice", "grammar")}
        fields["structured_outputs.json_object"] = ("json_object", outputs.json_object or None)
    return {param: pair for param, pair in fields.items() if pair[1] is not None}


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    match kind:
        case "json":
            schema = _schema(value, param)
            return GrammarSpec(kind="json_schema", source=json.dumps(schema))
        case "json_object":
            return GrammarSpec(kind="json_object")
        case "regex":
            if not value:
                raise InvalidRequest("the regex must not be empty", param=param)
            return GrammarSpec(kind="regex", source=value)
        case "choice":
            return GrammarSpec(kind="ebnf", source=_choice_grammar(value, param))
        case _:
            if not value.strip():
                raise InvalidRequest("the grammar must not be empty", param=param)
            return GrammarSpec(kind="ebnf", source=value)


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequest("the JSON schema is not JSON text", param=param) from exc
    if not isinstance(value, dict):
        raise InvalidRequest("the JSON schema must be an object", param=param)
    return value


def _choice_grammar(choices: list[str], param: str) -> str:
    """The output is exactly one of the strings (EBNF string literals take JSON's escapes)."""
    if not choices or len(choices) > MAX_CHOICES:
        raise InvalidRequest(f"choice needs 1 to {MAX_CHOICES} strings", param=param)
    if any(not choice for choice in choices):
        raise InvalidRequest("choice strings must not be empty", param=param)
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False)
                                    for choice in choices)
