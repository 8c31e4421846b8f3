"""Chat templates rendered the way Hugging Face tokenizer configs define `chat_template`."""

from __future__ import annotations

import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.chat_templates import CHATML_WITH_TOOLS
from shared.errors import ConfigError, InvalidRequest

# ChatML with Hermes-style tools, as Qwen2.5 renders them.
DEFAULT_CHAT_TEMPLATE = CHATML_WITH_TOOLS


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """As Hugging Face defines `tojson` for chat templates: plain JSON text, keys in their
    order (jinja's own filter sorts keys and returns HTML-safe markup)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise InvalidRequest(message, param="messages")


class ChatTemplate:
    """A compiled template; `render` returns the prompt text."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        self.source = source
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from exc

    @property
    def supports_tools(self) -> bool:
        """The template renders `tools` (Hugging Face templates that do name it)."""
        return "tools" in self.source

    def render(
        self, messages: list[dict[str, Any]], *, bos_token: str, eos_token: str,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True,
                bos_token=bos_token, eos_token=eos_token, tools=tools,
            )
        except InvalidRequest:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
