"""The gateway's checks on JSON schemas, and the JSON closer's bookkeeping."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engine.builtin_model import write_builtin_model
from engine.grammar import Grammars, GrammarVocab
from services.gateway.structured import check_grammar
from shared.errors import InvalidRequest
from shared.json_state import JsonState
from shared.messages import GrammarSpec


def schema(value: object) -> GrammarSpec:
    return GrammarSpec(kind="json_schema", source=json.dumps(value))


def test_a_valid_schema_with_local_references_passes() -> None:
    check_grammar(schema({"type": "object", "$defs": {"p": {"type": "integer"}},
                          "properties": {"not": {"$ref": "#/$defs/p"}}}))
    check_grammar(GrammarSpec(kind="json_object"))


@pytest.mark.parametrize(("value", "match"), [
    ({"type": "nonsense"}, "not a valid JSON schema"),
    ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "properties/a/minimum"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems'"),
    ({"allOf": [{"not": {"type": "string"}}]}, "'not' .at #/allOf/0"),
    ({"$ref": "#/$defs/missing"}, "does not resolve"),
    ({"$ref": "https://example.com/s.json"}, "only references inside"),
    ([1, 2], "must be a JSON object"),
])
def test_a_schema_the_workers_could_not_keep_is_refused(value: object, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as info:
        check_grammar(schema(value))
    assert info.value.param == "response_format"


@pytest.mark.parametrize(("text", "owed"), [
    ("", 1), ("{", 1), ('{"a', 4), ('{"a"', 3), ('{"a":', 2), ('{"a": "x', 2),
    ('{"a": "x\\"', 2), ('{"a": [1, {"b": 2', 3), ('{"a": [1, {"b": 2}]}', 0),
])
def test_the_json_state_counts_what_is_left_to_close(text: str, owed: int) -> None:
    assert JsonState().after(text.encode()).owed() == owed


def test_a_spec_compiles_once_per_worker(tmp_path: Path) -> None:
    model_dir = write_builtin_model(tmp_path / "model")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammars = Grammars(model_dir, vocab_size, [2])
    spec = schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    compiles: list[GrammarSpec] = []
    compile_one = grammars._compile

    def counted(spec: GrammarSpec) -> object:
        compiles.append(spec)
        return compile_one(spec)

    grammars._compile = counted  # type: ignore[method-assign,assignment]
    with ThreadPoolExecutor(8) as pool:  # a burst of requests with one schema
        burst = list(pool.map(grammars.compile, [spec] * 16))
    assert compiles == [spec] and all(g is burst[0] for g in burst)
    assert grammars.compile(spec) is burst[0]
    assert grammars.compile(GrammarSpec(kind="json_object")) is not burst[0]


def test_the_vocab_knows_which_tokens_write_a_surrogate() -> None:
    vocab = GrammarVocab([b"a", b"\xed\xa0", b"x\xed\xbf\x80", b"\xed", b"\xa0", b"\x9f",
                          b"\xed\x9f\xbf"], 8)
    assert vocab.surrogates.tolist() == [1, 2]  # U+D800.., U+DFC0: never valid UTF-8
    assert vocab.surrogate_tails.tolist() == [4]  # one only after a lone ED
    assert vocab.token_bytes[7] == b""  # padded to the model's vocabulary


@pytest.mark.parametrize("spec", [
    GrammarSpec(kind="regex", source='"[^"]{8}"'),
    schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 8}},
            "required": ["a"]}),
])
def test_grammar_outputs_never_write_a_surrogate(tmp_path: Path, spec: GrammarSpec) -> None:
    """xgrammar's character classes admit ED A0..BF (a surrogate, invalid UTF-8): decoded, it
    is three replacement characters. Sampling that prefers exactly those bytes still writes
    valid UTF-8, as long as the grammar asks, whole characters included."""
    model_dir = write_builtin_model(tmp_path / "model")
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    grammars = Grammars(model_dir, vocab_size, [2])
    matcher = grammars.matcher(spec)
    vocab = grammars._vocab
    assert vocab is not None
    one_byte = {b[0]: i for i, b in enumerate(vocab.token_bytes) if len(b) == 1}
    lure = torch.zeros(vocab_size)
    lure[one_byte[0xED]] = 8.0  # the lead byte, then a surrogate's second byte
    lure[[one_byte[b] for b in range(0xA0, 0xC0)]] = 6.0
    generator = torch.Generator().manual_seed(0)
    written = b""
    for step in range(40):
        logits = lure + torch.rand(vocab_size, generator=generator)
        matcher.mask(logits, remaining=40 - step, budget=40)
        token_id = int(torch.argmax(logits))
        if token_id == 2:  # the stop token: the grammar is complete
            break
        matcher.accept(token_id)
        written += vocab.token_bytes[token_id]
    assert b"\xed" in written  # the lure was taken where it is valid (ED 80..9F)
    text = written.decode()  # strict: raises on a surrogate
    if spec.kind == "regex":
        assert len(text) == 10 and text[0] == text[-1] == '"'
    else:
        assert len(json.loads(text)["a"]) <= 8
