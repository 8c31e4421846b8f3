"""vLLM's token filters at the gateway: allowed token ids checked, bad words tokenized as
vLLM tokenizes them (with a real tokenizer), and both carried to the sampler."""

from __future__ import annotations

import pytest

from engine.builtin_model import write_builtin_model
from services.gateway.openai_schema import CompletionRequest, decode_body
from services.gateway.token_filters import (
    MAX_BAD_WORDS,
    allowed_token_ids,
    bad_word_sequences,
)
from services.gateway.tokenizer import HfTokenizer
from services.gateway.validation import Limits, completion_output, validate
from shared.errors import InvalidRequest, UnsupportedParameter

LIMITS = Limits(model="m", max_model_len=32, vocab_size=258)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer(write_builtin_model(tmp_path_factory.mktemp("m") / "tiny"))


def run(body: bytes):
    request = decode_body(body, CompletionRequest)
    return validate(request, [1, 2], LIMITS, default_max_tokens=4,
                    output=completion_output(request))


def test_allowed_token_ids_are_checked_and_reach_the_sampler() -> None:
    assert allowed_token_ids(None, 10) == ()
    assert allowed_token_ids([7, 3, 7], 10) == (3, 7)
    for bad in ([], [10], [-1]):
        with pytest.raises(InvalidRequest) as info:
            allowed_token_ids(bad, 10)
        assert info.value.param == "allowed_token_ids"
    sampling = run(b'{"model": "m", "prompt": "x", "allowed_token_ids": [9, 4]}').sampling
    assert sampling.allowed_token_ids == (4, 9)


def test_a_bad_word_bans_its_sequence_and_the_one_after_a_space(tokenizer: HfTokenizer
                                                                 ) -> None:
    """vLLM's rule: the word with its leading spaces stripped, and " word" where that starts
    with another token and has as many tokens."""
    moon, spaced_moon = tokenizer.encode("moon"), tokenizer.encode(" moon")
    assert len(moon) == len(spaced_moon) == 1 and moon != spaced_moon  # this tokenizer's
    assert bad_word_sequences(["  moon"], tokenizer) == (tuple(moon), tuple(spaced_moon))
    quiet, spaced_quiet = tokenizer.encode("quiet"), tokenizer.encode(" quiet")
    assert len(quiet) == 3 and len(spaced_quiet) == 4
    assert bad_word_sequences(["quiet"], tokenizer) == (tuple(quiet),)
    assert bad_word_sequences(["moon", "quiet"], tokenizer) == (
        tuple(moon), tuple(spaced_moon), tuple(quiet))


def test_bad_words_out_of_limits_are_refused(tokenizer: HfTokenizer) -> None:
    assert bad_word_sequences(None, tokenizer) == ()
    for words in ([""], ["   "], ["x"] * (MAX_BAD_WORDS + 1), ["moon " * 600]):
        with pytest.raises(InvalidRequest) as info:
            bad_word_sequences(words, tokenizer)
        assert info.value.param == "bad_words"


def test_vllm_fields_are_accepted_at_values_that_ask_for_nothing_unserved() -> None:
    body = (b'{"model": "m", "prompt": "x", "use_beam_search": false, "length_penalty": 1.5, '
            b'"spaces_between_special_tokens": false, "priority": -3}')
    parsed = run(body)
    assert parsed.sampling.max_tokens == 4 and parsed.priority == -3
    with pytest.raises(UnsupportedParameter) as info:
        run(b'{"model": "m", "prompt": "x", "use_beam_search": true}')
    assert info.value.param == "use_beam_search"
    with pytest.raises(InvalidRequest) as invalid:
        run(b'{"model": "m", "prompt": "x", "priority": %d}' % 2**63)
    assert invalid.value.param == "priority"
