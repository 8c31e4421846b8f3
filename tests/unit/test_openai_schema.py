from __future__ import annotations

import pytest

from services.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    chat_messages,
    completion_prompt,
    decode_body,
    validate,
)
from shared.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound

LIMITS = Limits(model="m", max_model_len=32, vocab_size=258)


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest(**{"model": "m", "prompt": "hi", **fields})  # type: ignore[arg-type]


def run(request: CompletionRequest, prompt: list[int] | None = None,
        max_tokens: int | None = None):
    return validate(request, prompt or [1, 2], LIMITS, default_max_tokens=16,
                    max_tokens=max_tokens if max_tokens is not None else request.max_tokens)


def test_wrong_type_names_the_field() -> None:
    with pytest.raises(InvalidRequest) as info:
        decode_body(b'{"model": "m", "prompt": "x", "max_tokens": "ten"}', CompletionRequest)
    assert info.value.param == "max_tokens"


def test_invalid_json_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="invalid JSON"):
        decode_body(b"{nope", CompletionRequest)


def test_missing_required_field_is_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="prompt"):
        decode_body(b'{"model": "m"}', CompletionRequest)


def test_unknown_model_is_model_not_found() -> None:
    with pytest.raises(ModelNotFound, match="`other` does not exist"):
        run(completion(model="other"))


@pytest.mark.parametrize("n", [0, 2])
def test_n_other_than_one_is_refused(n: int) -> None:
    with pytest.raises(InvalidRequest, match="only n=1"):
        run(completion(n=n))


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_non_positive_max_tokens_is_refused(max_tokens: int) -> None:
    with pytest.raises(InvalidRequest, match="at least 1"):
        run(completion(max_tokens=max_tokens))


def test_max_tokens_beyond_the_context_is_refused() -> None:
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 32"):
        run(completion(max_tokens=31))


def test_prompt_at_the_context_limit_is_refused() -> None:
    with pytest.raises(ContextLengthExceeded):
        run(completion(), prompt=list(range(32)))


def test_default_max_tokens_is_capped_by_the_room_left() -> None:
    assert run(completion(), prompt=list(range(20))).sampling.max_tokens == 12


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"\[0, 258\)"):
        run(completion(), prompt=[1, 999])


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("top_p", 0.0),
                                              ("top_k", -2)])
def test_out_of_range_sampling_is_refused(field: str, value: float) -> None:
    with pytest.raises(InvalidRequest) as info:
        run(completion(**{field: value}))
    assert info.value.param == field


def test_stop_accepts_a_string_or_a_list_of_up_to_four() -> None:
    assert run(completion(stop="x")).stop == ["x"]
    with pytest.raises(InvalidRequest, match="at most 4"):
        run(completion(stop=["a", "b", "c", "d", "e"]))


def test_prompt_forms() -> None:
    assert completion_prompt(completion(prompt=[1, 2])) == [1, 2]
    assert completion_prompt(completion(prompt=["one"])) == "one"
    with pytest.raises(InvalidRequest, match="prompt must be"):
        completion_prompt(completion(prompt=["a", "b"]))


def test_empty_messages_are_refused() -> None:
    request = decode_body(b'{"model": "m", "messages": []}', ChatCompletionRequest)
    with pytest.raises(InvalidRequest, match="messages must not be empty"):
        chat_messages(request)


def test_text_parts_are_joined_and_other_parts_refused() -> None:
    body = (b'{"model": "m", "messages": [{"role": "user", "content": '
            b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}')
    assert chat_messages(decode_body(body, ChatCompletionRequest))[0]["content"] == "ab"
    image = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'
    with pytest.raises(InvalidRequest, match="only text parts"):
        chat_messages(decode_body(image, ChatCompletionRequest))


def test_unknown_role_is_refused() -> None:
    body = b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}'
    with pytest.raises(InvalidRequest, match="wizard"):
        chat_messages(decode_body(body, ChatCompletionRequest))
