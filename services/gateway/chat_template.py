"""Chat templates rendered the way Hugging Face tokenizer configs define `chat_template`."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
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


def _strftime_now(format_: str) -> str:
    """Today's date as the template spells it (Llama 3.x and SmolLM3 templates ask)."""
    return datetime.now().strftime(format_)


# What `render` itself passes: a request's template variables may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "bos_token", "eos_token",
                                "add_generation_prompt"})


class ChatTemplate:
    """A compiled template; `render` returns the prompt text."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE) -> None:
        # As Hugging Face compiles chat templates: `{% break %}`, `strftime_now`, `tojson`.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
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
        tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
        continue_final_message: bool = False, variables: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. `continue_final_message` leaves the last turn open (the output
        continues its text, as Hugging Face's `apply_chat_template` does); `variables` are
        the template's own settings (e.g. `enable_thinking`)."""
        if variables and (reserved := RESERVED_VARIABLES & variables.keys()):
            raise InvalidRequest(f"chat_template_kwargs may not set {sorted(reserved)}",
                                 param="chat_template_kwargs")
        try:
            text = self._template.render(
                **(variables or {}), messages=messages,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                bos_token=bos_token, eos_token=eos_token, tools=tools,
            )
        except InvalidRequest:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
        return _open_final_message(text, messages) if continue_final_message else text


def _open_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    """The prompt cut right after the last turn's text: what the template closes it with
    (an end-of-turn token, a newline) is left out, so the model writes on."""
    final = (messages[-1]["content"] or "").strip() if messages else ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise InvalidRequest("continue_final_message needs a last message whose text the "
                             "chat template renders", param="continue_final_message")
    return text[:at + len(final)]
