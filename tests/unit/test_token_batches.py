"""Token batches over NATS' payload limit go as several messages: split between deltas, a
long output into consecutive runs, a long prompt's logprobs into pieces ahead of its first
token; put back together they say what the one batch said."""

from __future__ import annotations

import msgspec

from shared.messages import TokenBatch, TokenDelta, TokenLogprob
from shared.token_batches import encoded_batches, is_prompt_piece

TOP = [(5, -0.5), (6, -1.25), (7, -2.0)]


def decoded(batches: list[bytes]) -> list[TokenDelta]:
    return [item for batch in batches
            for item in msgspec.json.decode(batch, type=TokenBatch).items]


def joined(deltas: list[TokenDelta]) -> TokenDelta:
    """The deltas of one request joined back, as the gateway reads them in order."""
    prompt: list[TokenLogprob] = []
    tokens: list[int] = []
    logprobs: list[TokenLogprob] = []
    for delta in deltas:
        if is_prompt_piece(delta):
            prompt += delta.prompt_logprobs or []
            continue
        assert delta.index == deltas[0].index + len(tokens)  # consecutive runs
        prompt += delta.prompt_logprobs or []
        tokens += delta.token_ids
        logprobs += delta.logprobs or []
    last = deltas[-1]
    return TokenDelta(request_id=last.request_id, index=deltas[0].index, token_ids=tokens,
                      finish_reason=last.finish_reason, num_cached_tokens=last.num_cached_tokens,
                      logprobs=logprobs or None, prompt_logprobs=prompt or None)


def test_a_batch_that_fits_goes_as_one_message_unchanged() -> None:
    items = [TokenDelta(request_id=f"r{i}", index=3, token_ids=[i]) for i in range(8)]
    (only,) = encoded_batches("decode-a", items, 1 << 20)
    assert only == msgspec.json.encode(TokenBatch(worker_id="decode-a", items=items))


def test_a_long_prompt_s_logprobs_go_in_pieces_ahead_of_its_first_token() -> None:
    prompt = [TokenLogprob(None), *(TokenLogprob(-0.1 * i, TOP, i) for i in range(1, 2000))]
    first = TokenDelta(request_id="r", index=0, token_ids=[42], num_cached_tokens=16,
                       logprobs=[TokenLogprob(-0.3, TOP)], prompt_logprobs=prompt)
    other = TokenDelta(request_id="s", index=7, token_ids=[9])
    batches = encoded_batches("prefill-a", [first, other], 16_384)
    assert len(batches) > 5 and all(len(batch) <= 16_384 for batch in batches)
    deltas = decoded(batches)
    mine = [delta for delta in deltas if delta.request_id == "r"]
    assert all(is_prompt_piece(delta) for delta in mine[:-1])
    assert not is_prompt_piece(mine[-1]) and mine[-1].token_ids == [42]
    assert joined(mine) == first
    assert [delta for delta in deltas if delta.request_id == "s"] == [other]


def test_a_long_output_goes_in_consecutive_runs_the_last_with_its_finish() -> None:
    tokens = list(range(3000))
    resent = TokenDelta(request_id="r", index=10, token_ids=tokens, finish_reason="length",
                        logprobs=[TokenLogprob(-1.0, TOP) for _ in tokens])
    batches = encoded_batches("decode-a", [resent], 32_768)
    assert len(batches) > 3 and all(len(batch) <= 32_768 for batch in batches)
    deltas = decoded(batches)
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert joined(deltas) == resent
