from __future__ import annotations

import pytest

from services.gateway.model_info import SamplingDefaults
from services.gateway.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    completion_prompts,
    decode_body,
)
from services.gateway.validation import Limits, Output, chat_output, completion_output, validate
from shared.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, UnsupportedParameter

LIMITS = Limits(model="m", max_model_len=32, vocab_size=258)


def completion(**fields: object) -> CompletionRequest:
    return CompletionRequest(**{"model": "m", "prompt": "hi", **fields})  # type: ignore[arg-type]


def run(request: CompletionRequest, prompt: list[int] | None = None):
    return validate(request, prompt or [1, 2], LIMITS, default_max_tokens=16,
                    output=completion_output(request), echo_text="hi")


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


@pytest.mark.parametrize("n", [0, 129])
def test_n_out_of_range_is_refused(n: int) -> None:
    """OpenAI's range (vLLM has none): pass@k evaluations sample 100 and more at once."""
    with pytest.raises(InvalidRequest, match=r"n must lie in \[1, 128\]"):
        run(completion(n=n))
    assert run(completion(n=128)).sampling.n == 128


@pytest.mark.parametrize("max_tokens", [0, -5])
def test_non_positive_max_tokens_is_refused(max_tokens: int) -> None:
    with pytest.raises(InvalidRequest, match="at least 1"):
        run(completion(max_tokens=max_tokens))


def test_max_tokens_zero_with_echo_is_the_prompt_alone() -> None:
    parsed = run(completion(max_tokens=0, echo=True, logprobs=2))
    assert parsed.is_prompt_only and parsed.echo == "hi"
    assert parsed.sampling.max_tokens == 1 and parsed.sampling.prompt_logprobs == 2


def test_max_completion_tokens_and_max_tokens_must_agree() -> None:
    assert run(completion(max_completion_tokens=5)).sampling.max_tokens == 5
    assert run(completion(max_tokens=5, max_completion_tokens=5)).sampling.max_tokens == 5
    with pytest.raises(InvalidRequest) as info:
        run(completion(max_tokens=5, max_completion_tokens=6))
    assert info.value.param == "max_completion_tokens"


@pytest.mark.parametrize(("body", "param"), [
    (b'{"model": "m", "prompt": "x", "frobnicate": 1}', "frobnicate"),
    (b'{"model": "m", "prompt": "x", "tools": []}', "tools"),
    (b'{"model": "m", "prompt": "x", "suffix": "y"}', "suffix"),
    (b'{"model": "m", "prompt": "x", "stream_options": {"chunked": true}}',
     "stream_options.chunked"),
])
def test_a_field_not_served_is_refused_by_name(body: bytes, param: str) -> None:
    with pytest.raises(UnsupportedParameter) as info:
        decode_body(body, CompletionRequest)
    assert info.value.param == param and param in info.value.message
    assert info.value.openai_code == "unsupported_parameter"


def test_a_field_not_served_sent_as_null_is_taken_as_unset() -> None:
    body = b'{"model": "m", "prompt": "x", "suffix": null, "tools": null, "max_tokens": 3}'
    assert run(decode_body(body, CompletionRequest)).sampling.max_tokens == 3
    body = b'{"model": "m", "messages": [], "audio": null, "prediction": null}'
    assert decode_body(body, ChatCompletionRequest).model == "m"
    with pytest.raises(UnsupportedParameter) as info:  # one null, one with a value
        decode_body(b'{"model": "m", "prompt": "x", "tools": null, "suffix": "y"}',
                    CompletionRequest)
    assert info.value.param == "suffix"


def test_metadata_fields_are_accepted() -> None:
    body = (b'{"model": "m", "prompt": "x", "user": "u", "metadata": {"k": "v"}, '
            b'"store": false, "service_tier": "auto", "prompt_cache_key": "p", '
            b'"safety_identifier": "s"}')
    assert run(decode_body(body, CompletionRequest)).sampling.max_tokens == 16


def test_a_chat_message_field_not_served_is_refused() -> None:
    for field in ("audio", "function_call"):
        body = (b'{"model": "m", "messages": [{"role": "user", "content": "x", "%s": {}}]}'
                % field.encode())
        with pytest.raises(UnsupportedParameter) as info:
            chat_messages(decode_body(body, ChatCompletionRequest))
        assert info.value.param == f"messages[0].{field}"
    with pytest.raises(UnsupportedParameter) as info:
        decode_body(b'{"model": "m", "messages": [{"role": "user", "content": "x", '
                    b'"frobnicate": 1}]}', ChatCompletionRequest)
    assert info.value.param == "messages[0].frobnicate"


def test_an_assistant_reply_sent_back_whole_is_its_turn() -> None:
    """`messages.append(reply.choices[0].message.model_dump())`: every field of the reply's
    message, null where unset, and its citations."""
    reply = (b'{"role": "assistant", "content": "hello", "refusal": null, "annotations": '
             b'[{"type": "url_citation"}], "audio": null, "function_call": null, '
             b'"tool_calls": null}')
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}, %s]}' % reply
    assert chat_messages(decode_body(body, ChatCompletionRequest))[1] == {
        "role": "assistant", "content": "hello"}


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("min_p", 1.5), ("min_tokens", 17), ("logprobs", 21), ("logprobs", -1),
    ("stop_token_ids", [258]), ("best_of", 129),
    ("logit_bias", {"258": 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", {"5": 101.0}),
])
def test_out_of_range_controls_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        run(completion(**{field: value}))
    assert info.value.param == field


def test_top_p_zero_is_taken_as_openai_takes_it() -> None:
    assert run(completion(top_p=0.0)).sampling.top_p == 0.0  # the likeliest token alone


def test_best_of_samples_its_candidates_with_logprobs_and_returns_n() -> None:
    parsed = run(completion(best_of=5, n=2))
    assert parsed.sampling.n == 5 and parsed.num_returned == 2
    assert parsed.sampling.logprobs == 0  # to rank them by, asked for or not
    plain = run(completion(best_of=2, n=2))  # best_of == n: n choices, as without it
    assert plain.sampling.n == 2 and plain.num_returned is None
    assert plain.sampling.logprobs is None
    with pytest.raises(InvalidRequest, match="cannot be streamed"):
        run(completion(best_of=3, stream=True))
    with pytest.raises(InvalidRequest, match="at least n"):
        run(completion(best_of=2, n=3))


def test_controls_reach_the_sampling_parameters() -> None:
    sampling = run(completion(
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2, min_p=0.1,
        min_tokens=3, ignore_eos=True, stop_token_ids=[7], logit_bias={"9": -100, "3": 5},
        logprobs=4, top_k=-1)).sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (0.5, -0.5)
    assert (sampling.repetition_penalty, sampling.min_p, sampling.min_tokens) == (1.2, 0.1, 3)
    assert sampling.ignore_eos and sampling.stop_token_ids == (7,)
    assert sampling.logit_bias == ((3, 5.0), (9, -100.0))
    assert sampling.logprobs == 4 and sampling.prompt_logprobs is None and sampling.top_k is None


def test_chat_logprobs_need_logprobs_true_and_at_most_twenty() -> None:
    def chat(**fields: object) -> ChatCompletionRequest:
        return ChatCompletionRequest(model="m", messages=[], **fields)  # type: ignore[arg-type]

    assert chat_output(chat(logprobs=True, top_logprobs=3)) == Output(logprobs=3)
    assert chat_output(chat(logprobs=True)) == Output(logprobs=0)
    assert chat_output(chat()) == Output()
    for fields in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(InvalidRequest) as info:
            chat_output(chat(**fields))
        assert info.value.param == "top_logprobs"


def test_max_tokens_beyond_the_context_is_refused() -> None:
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 32"):
        run(completion(max_tokens=31))


def test_prompt_at_the_context_limit_is_refused() -> None:
    with pytest.raises(ContextLengthExceeded):
        run(completion(), prompt=list(range(32)))


def test_default_max_tokens_is_capped_by_the_room_left() -> None:
    assert run(completion(), prompt=list(range(20))).sampling.max_tokens == 12


def test_a_chat_request_without_max_tokens_gets_the_model_s_max_new_tokens() -> None:
    """As vLLM reads `generation_config.json`: the default, within the room left; a request's
    own `max_tokens`, and a completion's OpenAI default of 16, win over it."""
    limits = Limits(model="m", max_model_len=32, vocab_size=258,
                    sampling_defaults=SamplingDefaults(max_tokens=8))

    def max_tokens(prompt: list[int], default: int | None = None, **fields: object) -> int:
        request = ChatCompletionRequest(model="m", messages=[], **fields)  # type: ignore[arg-type]
        return validate(request, prompt, limits, default_max_tokens=default,
                        output=chat_output(request)).sampling.max_tokens

    assert max_tokens([1, 2]) == 8
    assert max_tokens(list(range(28))) == 4  # the room the context leaves
    assert max_tokens([1, 2], max_tokens=20) == 20
    assert max_tokens([1, 2], default=16) == 16
    assert run(completion(), prompt=[1, 2]).sampling.max_tokens == 16  # no model default


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"\[0, 258\)"):
        run(completion(), prompt=[1, 999])


def test_fields_a_request_leaves_out_take_the_model_s_sampling_defaults() -> None:
    qwen = Limits(model="m", max_model_len=32, vocab_size=258, sampling_defaults=SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, repetition_penalty=1.05))

    def sampling(**fields: object):
        request = completion(**fields)
        return validate(request, [1, 2], qwen, default_max_tokens=16,
                        output=completion_output(request), echo_text="hi").sampling

    left_out = sampling()
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.min_p,
            left_out.repetition_penalty) == (0.7, 0.8, 20, 0.05, 1.05)
    sent = sampling(temperature=0.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0)
    assert (sent.temperature, sent.top_p, sent.top_k, sent.min_p,
            sent.repetition_penalty) == (0.0, 1.0, None, 0.0, 1.0)  # top_k -1: off
    plain = run(completion()).sampling  # OpenAI's defaults
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, None)


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("top_p", -0.1),
                                              ("top_p", 1.01), ("top_k", -2)])
def test_out_of_range_sampling_is_refused(field: str, value: float) -> None:
    with pytest.raises(InvalidRequest) as info:
        run(completion(**{field: value}))
    assert info.value.param == field


def test_stop_accepts_a_string_or_a_list_past_openai_s_four() -> None:
    """As vLLM does: lm-eval's HumanEval task sends these five."""
    assert run(completion(stop="x")).stop == ["x"]
    humaneval = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
    assert run(completion(stop=humaneval)).stop == humaneval
    with pytest.raises(InvalidRequest, match="at most 64"):
        run(completion(stop=[str(i) for i in range(65)]))


def test_every_prompt_form() -> None:
    assert completion_prompts(completion(prompt="one")) == ["one"]
    assert completion_prompts(completion(prompt=[1, 2])) == [[1, 2]]
    assert completion_prompts(completion(prompt=["one"])) == ["one"]
    assert completion_prompts(completion(prompt=["a", "b"])) == ["a", "b"]
    assert completion_prompts(completion(prompt=[[1, 2]])) == [[1, 2]]
    assert completion_prompts(completion(prompt=[[1], [2, 3]])) == [[1], [2, 3]]
    for bad in ([], [[]], [1, "a"], [[1], "a"], [True], [[1.5]]):
        with pytest.raises(InvalidRequest, match="prompt must"):
            completion_prompts(completion(prompt=bad))


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


def test_a_text_part_without_text_says_so() -> None:
    request = decode_body(b'{"model": "m", "messages": [{"role": "user", "content": '
                          b'[{"type": "text"}]}]}', ChatCompletionRequest)
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content: a text part needs"):
        chat_messages(request)


def test_chat_max_tokens_zero_does_not_mention_echo() -> None:
    request = decode_body(b'{"model": "m", "messages": [], "max_tokens": 0}',
                          ChatCompletionRequest)
    with pytest.raises(InvalidRequest, match=r"^max_tokens must be at least 1$"):
        validate(request, [1, 2], LIMITS, default_max_tokens=None, output=chat_output(request))
