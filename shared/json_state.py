"""Where a JSON text stands, character by character: open containers, an open string, and
what comes next. The engine uses it to close a JSON output before its token limit; the
gateway to find where a streamed tool call's arguments end."""

from __future__ import annotations


class JsonState:
    """Where a compact JSON text stands: open containers, an open string (key or value),
    and what the innermost container expects next."""

    __slots__ = ("escape", "expect", "in_string", "is_key", "stack")

    def __init__(self) -> None:
        self.stack: list[str] = []  # "{" or "["
        self.in_string = self.is_key = self.escape = False
        self.expect = "value"  # value | key | colon | after

    def copy(self) -> JsonState:
        other = JsonState()
        other.stack = list(self.stack)
        other.in_string, other.is_key, other.escape = self.in_string, self.is_key, self.escape
        other.expect = self.expect
        return other

    def after(self, data: bytes) -> JsonState:
        state = self.copy()
        for byte in data:
            state.push(chr(byte))
        return state

    def push(self, char: str) -> None:
        """Take the text's next character."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                self.expect = "colon" if self.is_key else "after"
            return
        if char == '"':
            self.in_string, self.is_key = True, self.expect == "key"
        elif char in "{[":
            self.stack.append(char)
            self.expect = "key" if char == "{" else "value"
        elif char in "}]":
            if self.stack:
                self.stack.pop()
            self.expect = "after"
        elif char == ":":
            self.expect = "value"
        elif char == ",":
            self.expect = "key" if self.stack and self.stack[-1] == "{" else "value"
        elif not char.isspace():
            self.expect = "after"  # a number or literal, under way

    def owed(self) -> int:
        owed = len(self.stack)
        if self.in_string:
            owed += 1 + (2 if self.is_key else 0)  # the quote; a key's colon and value
        elif self.expect == "colon":
            owed += 2
        elif self.expect == "value":
            owed += 1
        return owed
