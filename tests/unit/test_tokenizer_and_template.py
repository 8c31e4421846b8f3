from __future__ import annotations

import pytest

from services.gateway.chat_template import ChatTemplate
from services.gateway.tokenizer import ByteTokenizer
from shared.errors import ConfigError, InvalidRequest


def test_byte_tokenizer_round_trips_unicode() -> None:
    tokenizer = ByteTokenizer()
    text = "héllo, 世界"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_detokenizer_holds_back_partial_characters() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("世")
    detok = tokenizer.detokenizer()
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:]) == "世"
    assert detok.flush() == ""


def test_default_template_renders_chatml_with_generation_prompt() -> None:
    text = ChatTemplate().render([{"role": "user", "content": "hi"}], bos_token="<s>",
                                 eos_token="</s>")
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_template_raise_exception_becomes_invalid_request() -> None:
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        template.render([], bos_token="", eos_token="")


def test_template_that_does_not_compile_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_template_cannot_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequest):
        template.render([], bos_token="", eos_token="")


CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The moon "}]


def test_continue_final_message_leaves_the_last_turn_open() -> None:
    text = ChatTemplate().render(CHAT, bos_token="", eos_token="",
                                 continue_final_message=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nThe moon"


def test_continue_final_message_needs_text_the_template_renders() -> None:
    with pytest.raises(InvalidRequest, match="continue_final_message") as info:
        ChatTemplate().render([*CHAT[:1], {"role": "assistant", "content": ""}],
                              bos_token="", eos_token="", continue_final_message=True)
    assert info.value.param == "continue_final_message"


def test_without_generation_prompt_the_conversation_ends_closed() -> None:
    text = ChatTemplate().render(CHAT[:1], bos_token="", eos_token="",
                                 add_generation_prompt=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"


def test_template_variables_reach_the_template() -> None:
    template = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}"
                            "no-think {% endif %}{{ messages[0].content }}")
    assert template.render(CHAT, bos_token="", eos_token="",
                           variables={"enable_thinking": False}) == "no-think hi"
    assert template.render(CHAT, bos_token="", eos_token="") == "hi"


def test_template_variables_cannot_replace_what_render_passes() -> None:
    with pytest.raises(InvalidRequest, match=r"\['messages'\]") as info:
        ChatTemplate().render(CHAT, bos_token="", eos_token="",
                              variables={"messages": [], "enable_thinking": True})
    assert info.value.param == "chat_template_kwargs"


def test_templates_get_hugging_faces_loop_controls_and_date() -> None:
    """Llama 3.x and SmolLM3 templates call `strftime_now`; some break out of loops."""
    template = ChatTemplate("{{ strftime_now('%Y') }}{% for m in messages %}{{ m.role }}"
                            "{% break %}{% endfor %}")
    text = template.render(CHAT, bos_token="", eos_token="")
    assert text[:4].isdigit() and int(text[:4]) >= 2024 and text[4:] == "user"
