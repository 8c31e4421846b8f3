from __future__ import annotations

import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.tokenizer import HfTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(write_builtin_model(tmp_path_factory.mktemp("m") / "tiny"))


@pytest.mark.parametrize("text", ["Hello! How are you today?", "naïve café — 世界 🌙 ok",
                                  "def add(a, b):\n    return a + b"])
def test_streaming_detokenization_equals_whole_decode(tokenizer: HfTokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = tokenizer.detokenizer()
    streamed = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert streamed == tokenizer.decode(ids) == text


def test_partial_characters_are_never_emitted(tokenizer: HfTokenizer) -> None:
    detok = tokenizer.detokenizer()
    pieces = [detok.push([i]) for i in tokenizer.encode("🌙🌙")]
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_and_template_come_from_the_model(tokenizer: HfTokenizer) -> None:
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id is not None
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.decode(tokenizer.encode("<|im_end|>x")) == "x"
