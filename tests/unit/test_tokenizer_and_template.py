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
