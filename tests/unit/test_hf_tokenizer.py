from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from engine.builtin_model import write_builtin_model
from services.gateway.model_catalog import load_model_files
from services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest, decode_body
from services.gateway.service import GatewayService
from services.gateway.tokenizer import HfTokenizer
from shared.config import GatewayConfig


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


def test_a_prompt_gets_the_tokenizer_s_bos_unless_asked_not_to_and_chat_only_if_asked(
        tmp_path: Path) -> None:
    """vLLM's `add_special_tokens`: by default a completion's prompt gets what the tokenizer
    adds (a Llama tokenizer's BOS), a chat prompt only its template's."""
    model_dir = write_builtin_model(tmp_path / "with-bos", hidden_size=32, num_layers=1)
    rust = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = rust.token_to_id("<|endoftext|>")
    rust.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                             special_tokens=[("<|endoftext|>", bos)])
    rust.save(str(model_dir / "tokenizer.json"))
    model = load_model_files("m", model_dir, 2048)
    gateway = GatewayService(GatewayConfig(model="m"))
    text_ids = model.tokenizer.encode("Once upon a time")

    def prompt(**fields: object) -> list[int]:
        request = decode_body(json.dumps({"model": "m", "prompt": "Once upon a time", **fields})
                              .encode(), CompletionRequest)
        return gateway.parse_completion(request, model)[0].prompt_token_ids

    def chat(**fields: object) -> list[int]:
        request = decode_body(json.dumps({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode(),
            ChatCompletionRequest)
        return gateway.parse_chat(request, model)[0].prompt_token_ids

    assert prompt() == [bos, *text_ids]
    assert prompt(add_special_tokens=False) == text_ids
    assert chat()[0] != bos
    assert chat(add_special_tokens=True) == [bos, *chat()]
