"""Tool calling at the gateway: which tools a chat request offers and how it lets the model
use them (`tool_choice`), the grammar that forces a call (`required` or a named function),
and the parsers that find calls in the model's output, whole or streamed.

Formats, by model family (chosen from the chat template, `tool_format`):
  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with
               text around them (Qwen2.5, Hermes, the built-in template);
  llama3_json  the whole output is `{"name": ..., "parameters": {...}}`, optionally after
               `<|python_tag|>` (Llama 3.1/3.2).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.errors import InvalidRequest
from shared.messages import GrammarSpec

ToolFormat = Literal["hermes", "llama3_json"]
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


def tool_format(template_source: str) -> ToolFormat:
    """The call format a chat template teaches its model."""
    if PYTHON_TAG in template_source or "ipython" in template_source:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolUse:
    """How one request may call tools."""

    format: ToolFormat
    names: frozenset[str]
    is_forced: bool  # `required` or a named function: the output is a call
    is_parallel: bool = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The output's text outside calls, and its calls (only offered tools)."""
        content, calls = (_parse_hermes(text) if self.format == "hermes"
                          else _parse_llama3(text))
        calls = [c for c in calls if c.name in self.names]
        if not calls:
            return text, []
        return content, calls if self.is_parallel else calls[:1]

    @property
    def start_markers(self) -> tuple[str, ...]:
        """Text after which the output may be a call: held back when streaming."""
        return ("<tool_call>",) if self.format == "hermes" else (PYTHON_TAG, "{")


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls = []
    for body in _HERMES_CALL.findall(text):
        call = _call_from_json(body, "arguments")
        if call is not None:
            calls.append(call)
    return _HERMES_CALL.sub("", text).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = []
    for part in body.split(";") if body.startswith("{") else []:
        call = _call_from_json(part, "parameters") or _call_from_json(part, "arguments")
        if call is None:
            return text, []
        calls.append(call)
    return "", calls


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def forced_call_grammar(tools: dict[str, dict[str, Any]], fmt: ToolFormat) -> GrammarSpec:
    """The grammar of one call to one of `tools` (name -> parameters schema), in `fmt`: the
    arguments then validate against the function's parameters."""
    key = "arguments" if fmt == "hermes" else "parameters"
    options = [{"type": "object", "properties": {"name": {"const": name}, key: parameters},
                "required": ["name", key]} for name, parameters in tools.items()]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    begin, end = ("<tool_call>", "</tool_call>") if fmt == "hermes" else ("", "")
    return GrammarSpec(kind="json_schema", source=json.dumps(schema), begin=begin, end=end)


def check_function_name(name: str, param: str) -> None:
    if not FUNCTION_NAME.match(name):
        raise InvalidRequest(f"function name {name!r} must be 1-64 letters, digits, _ or -",
                             param=param)


class ToolCallStream:
    """Streams a choice's text while it cannot be a call, and holds the rest back from the
    first possible call marker on; `finish` parses what was held."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self._held = ""
        self._is_holding = use.is_forced
        self._sent = ""

    def push(self, text: str) -> str:
        """The part of `text` safe to stream now."""
        if self._is_holding:
            self._held += text
            return ""
        self._held += text
        for marker in self.use.start_markers:
            at = self._held.find(marker)
            if at >= 0 and (marker != "{" or not (self._sent + self._held[:at]).strip()):
                self._is_holding = True
                out, self._held = self._held[:at], self._held[at:]
                self._sent += out
                return out
        keep = max((_partial_suffix(self._held, m) for m in self.use.start_markers), default=0)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self._sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The held text that is not a call, and the calls."""
        held, self._held = self._held, ""
        if not held:
            return "", []
        content, calls = self.use.parse(held)
        return content, calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
