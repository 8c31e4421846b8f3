"""vLLM's chat template extensions through the `openai` SDK on the built-in model:
`continue_final_message` writes on from the last turn's text, `add_generation_prompt: false`
and `chat_template_kwargs` reach the template, and a misuse is a 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from services.gateway.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from services.gateway.tokenizer import HfTokenizer

pytestmark = pytest.mark.e2e

MODEL = "halfmoon-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me of the harbour."},
                       {"role": "assistant", "content": "The half moon rose over"}]


def prompt_ids(tiny_dir: Path, **options: Any) -> list[int]:
    """The prompt the gateway should build: the model's template rendered, then encoded."""
    tokenizer = HfTokenizer(tiny_dir)
    template = ChatTemplate(tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE)
    return tokenizer.encode(template.render(MESSAGES, bos_token=tokenizer.bos_token,
                                            eos_token=tokenizer.eos_token, **options))


@pytest.mark.parametrize("options", [
    {"continue_final_message": True, "add_generation_prompt": False},
    {"add_generation_prompt": False}])
async def test_the_chat_prompt_is_the_template_rendered_so(
        sdk: openai.AsyncOpenAI, tiny_dir: Path, options: dict[str, Any]) -> None:
    ids = prompt_ids(tiny_dir, **options)
    chat = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                             temperature=0, extra_body=options)
    completion = await sdk.completions.create(model=MODEL, prompt=ids, max_tokens=6,
                                              temperature=0)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == completion.choices[0].text


async def test_template_variables_a_template_does_not_read_change_nothing(
        sdk: openai.AsyncOpenAI) -> None:
    """The built-in ChatML template has no `enable_thinking`: accepted, the same prompt (that
    a template reading it gets it: tests/unit/test_tokenizer_and_template.py)."""
    plain = await sdk.chat.completions.create(model=MODEL, messages=MESSAGES[:1],
                                              max_tokens=1)
    with_variables = await sdk.chat.completions.create(
        model=MODEL, messages=MESSAGES[:1], max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.usage is not None and with_variables.usage is not None
    assert with_variables.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
])
async def test_a_misused_template_option_is_a_400(sdk: openai.AsyncOpenAI,
                                                  extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,
                                          extra_body=extra)
    assert info.value.body["param"] == param  # type: ignore[index]
