"""Tool calls streamed as the model writes them, as OpenAI streams `delta.tool_calls`: a
call's id and name once its head is written, then its arguments text piece by piece until
their object closes (`shared/json_state.py` follows it). Heads, by format:
  hermes       `<tool_call>{"name": "...", "arguments": {`, anywhere in the output;
  llama3_json  `{"name": "...", "parameters": {` (or "arguments") at the output's start,
               after an optional `<|python_tag|>`, and after each `;` between calls.

Fed the whole output of a choice; it finds the calls itself. A call to a tool not offered,
a second call when calls are not parallel, or one not in that shape (another key order, say)
is not streamed: the parse at the end (`ToolUse.parse`) finds what it can of those, and
`unsent` gives them whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.tool_calls import PYTHON_TAG, ToolCall, ToolCallStream, ToolUse
from shared.json_state import JsonState

_MARKER, _END = "<tool_call>", "</tool_call>"
_HEADS = {fmt: re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"'
                          + keys + r'"\s*:')
          for fmt, keys in (("hermes", "arguments"), ("llama3_json", "(?:parameters|arguments)"))}
_HEAD_MAX_CHARS = 256  # a head not complete by then is not one this streams
_BETWEEN_CALLS = re.compile(r"\s*\}\s*;")  # llama3_json: a call's end, then the next's


class CallStream:
    """A choice's output when it may call tools: the text safe to stream (`ToolCallStream`
    holds back what may be a call) and the `delta.tool_calls` entries of its calls, streamed
    as they are written, or whole at the end (other shapes)."""

    def __init__(self, use: ToolUse) -> None:
        self._text = ToolCallStream(use)
        self._arguments = CallArguments(use)
        self.has_calls = False  # known at the end: whether the output called a tool

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The part of `text` safe to stream now, and the call entries it completes."""
        return self._text.push(text), self._arguments.feed(text)

    def finish(self, *, is_cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """At the end: the held text that is not a call, and the calls not streamed yet. An
        output cut short (`is_cut`: by max_tokens) inside a call is not text: what was
        written of the call went out as the call (once its head was complete, its arguments
        cut short), and a forced call's output is never text."""
        rest, calls = self._text.finish()
        self.has_calls = bool(calls) or bool(self._arguments.calls)
        if is_cut and not calls and (self._arguments.calls or self._text.use.is_forced):
            rest = ""
        return rest, self._arguments.unsent(calls)

    @property
    def streamed_calls(self) -> list[ToolCall]:
        """The calls streamed so far, each as far as it was written."""
        return [ToolCall(call.name, call.arguments, call.id) for call in self._arguments.calls]


def cut_calls(use: ToolUse, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output cut short inside a call, read as its stream is (`CallStream`): the
    text that is not a call, and each call as far as it was written."""
    stream = CallStream(use)
    sent, _ = stream.push(text)
    rest, _ = stream.finish(is_cut=True)
    return sent + rest, stream.streamed_calls


@dataclass
class StreamedCall:
    id: str
    name: str
    arguments: str = ""  # the JSON text sent so far


class CallArguments:
    """The `delta.tool_calls` entries of one choice's calls, as its text arrives."""

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.calls: list[StreamedCall] = []
        self._text = ""
        self._at = 0  # where the scan goes on in `_text`
        self._is_hermes = use.format == "hermes"
        self._head_pattern = _HEADS[use.format]
        self._state = self._seek if self._is_hermes else self._lead
        self._name = ""  # of the call whose arguments are about to begin
        self._json = JsonState()  # where the arguments' text stands

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The delta entries that `text`, the choice's next output, completes."""
        self._text += text
        deltas: list[dict[str, Any]] = []
        while self._state(deltas):  # each step says whether it moved on
            pass
        return _merged(deltas)

    def unsent(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """Delta entries, whole, for the calls parsed at the end that were not streamed
        (those that were are matched in order, by name)."""
        streamed = iter(self.calls)
        pending = next(streamed, None)
        entries = []
        for call in calls:
            if pending is not None and call.name == pending.name:
                pending = next(streamed, None)
                continue
            entries.append({"index": len(self.calls) + len(entries), **call.body()})
        return entries

    def _seek(self, deltas: list[dict[str, Any]]) -> bool:
        return self._past(_MARKER, self._head)

    def _lead(self, deltas: list[dict[str, Any]]) -> bool:
        """llama3_json: the output is calls from its start (after an optional tag), or none."""
        rest = self._text[self._at:].lstrip()
        if PYTHON_TAG.startswith(rest):
            return False  # nothing yet, or the tag's start
        self._at = len(self._text) - len(rest)
        if rest.startswith(PYTHON_TAG):
            self._at += len(PYTHON_TAG)
        self._state = self._head
        return True

    def _between(self, deltas: list[dict[str, Any]]) -> bool:
        """llama3_json, past a call's arguments: its closing brace and `;`, then the next."""
        match = _BETWEEN_CALLS.match(self._text, self._at)
        if match is not None:
            self._at, self._state = match.end(), self._head
            return True
        if self._text[self._at:].strip() not in ("", "}"):
            self._state = self._done  # not another call: the parse at the end decides
            return True
        return False

    def _done(self, deltas: list[dict[str, Any]]) -> bool:
        return False

    def _not_streamed(self) -> None:
        """This call is not streamed: on to the next call (Hermes), or stop (llama3_json)."""
        self._state = self._skip if self._is_hermes else self._done

    def _skip(self, deltas: list[dict[str, Any]]) -> bool:
        return self._past(_END, self._seek)

    def _past(self, marker: str, then: Callable[[list[dict[str, Any]]], bool]) -> bool:
        """Move past the next `marker`, on to the step `then`; False while it has not come."""
        at = self._found(marker)
        if at < 0:
            return False
        self._at, self._state = at + len(marker), then
        return True

    def _found(self, marker: str) -> int:
        """Where `marker` begins past the scan's place, or -1; the place moves on to where
        the marker could still begin (a long output is not scanned again per chunk)."""
        at = self._text.find(marker, self._at)
        if at < 0:
            self._at = max(self._at, len(self._text) - len(marker) + 1)
        return at

    def _head(self, deltas: list[dict[str, Any]]) -> bool:
        match = self._head_pattern.match(self._text, self._at)
        if match is None:
            left = self._text[self._at:]
            if len(left) > _HEAD_MAX_CHARS or _END in left or not (
                    self._is_hermes or left.lstrip()[:1] in ("", "{")):
                self._not_streamed()
                return True
            return False  # the head may still come
        try:
            name = json.loads(f'"{match.group(1)}"')
        except ValueError:
            name = None
        if name not in self.use.names or (self.calls and not self.use.is_parallel):
            self._not_streamed()
            return True
        self._name, self._at, self._state = name, match.end(), self._opening
        return True

    def _opening(self, deltas: list[dict[str, Any]]) -> bool:
        """Past the head: the arguments must open an object, else the call is not streamed."""
        rest = self._text[self._at:]
        if not rest.strip():
            return False
        if not rest.lstrip().startswith("{"):
            self._not_streamed()
            return True
        call = StreamedCall(f"call_{uuid.uuid4().hex[:24]}", self._name)
        self.calls.append(call)
        deltas.append({"index": len(self.calls) - 1,
                       **ToolCall(call.name, "", call.id).body()})
        self._at += len(rest) - len(rest.lstrip())
        self._json = JsonState()
        self._state = self._arguments
        return True

    def _arguments(self, deltas: list[dict[str, Any]]) -> bool:
        start = end = self._at
        is_closed = False
        for char in self._text[start:]:
            end += 1
            self._json.push(char)
            if not self._json.stack:  # the arguments' object closed
                is_closed = True
                break
        if end > start:
            piece = self._text[start:end]
            self.calls[-1].arguments += piece
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
        self._at = end
        if is_closed:  # on to the end of this call
            self._state = self._skip if self._is_hermes else self._between
        return is_closed



def _merged(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call: a call's opening and arguments in one chunk go out together."""
    merged: list[dict[str, Any]] = []
    for entry in entries:
        if merged and merged[-1]["index"] == entry["index"]:
            function = merged[-1]["function"]
            function["arguments"] += entry["function"]["arguments"]
        else:
            merged.append({**entry, "function": dict(entry["function"])})
    return merged
