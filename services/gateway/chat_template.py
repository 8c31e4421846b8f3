"""Chat templates rendered the way Hugging Face tokenizer configs define `chat_template`."""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.errors import ConfigError, InvalidRequest

# ChatML, as used by Qwen2 and many others.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise InvalidRequest(message, param="messages")


class ChatTemplate:
    """A compiled template; `render` returns the prompt text."""

    def __init__(self, source: str = DEFAULT_CHAT_TEMPLATE) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"chat template does not compile: {exc}") from exc

    def render(
        self, messages: list[dict[str, Any]], *, bos_token: str, eos_token: str
    ) -> str:
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True,
                bos_token=bos_token, eos_token=eos_token,
            )
        except InvalidRequest:
            raise
        except jinja2.TemplateError as exc:
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
