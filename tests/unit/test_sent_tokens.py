"""What a decode worker sends again when a gateway's stream stalled, and what the gateway
asks for."""

from __future__ import annotations

from services.decode.sent_tokens import SentTokens
from services.gateway.request_stream import StreamTable
from shared.messages import (
    GenerateRequest,
    RequestPlaced,
    ResumePoint,
    SamplingParams,
    TokenBatch,
    TokenDelta,
)

REQUEST = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1, 2], reply_subject="g",
                          sampling=SamplingParams(max_tokens=8), created_at_s=0.0,
                          output_offset=3)


def test_every_token_from_the_missing_index_is_sent_again_with_the_finish() -> None:
    sent = SentTokens(keep_s=30)
    sent.open(REQUEST, [70])  # index 3: prefill's first token
    sent.record("r", 71, None)
    sent.record("r", 72, "length")
    delta = sent.resend(ResumePoint(request_id="r", next_index=4))
    assert delta == TokenDelta(request_id="r", index=4, token_ids=[71, 72],
                               finish_reason="length")


def test_nothing_is_sent_when_the_gateway_has_everything_or_the_request_is_unknown() -> None:
    sent = SentTokens(keep_s=30)
    sent.open(REQUEST, [70])
    assert sent.resend(ResumePoint(request_id="r", next_index=4)) is None
    assert sent.resend(ResumePoint(request_id="other", next_index=0)) is None


def test_finished_streams_are_kept_for_a_while_then_forgotten() -> None:
    sent = SentTokens(keep_s=30)
    sent.open(REQUEST, [70])
    sent.record("r", 71, "stop")
    sent.expire(now_s=0.0)
    assert len(sent) == 1
    sent.expire(now_s=1e12)
    assert len(sent) == 0


def test_the_gateway_asks_each_decode_worker_about_its_stalled_streams_once_per_interval(
        ) -> None:
    table = StreamTable()
    stream = table.open("r")
    table.dispatch(RequestPlaced(request_id="r", prefill_worker_id="p", decode_worker_id="d"))
    table.dispatch(TokenBatch(worker_id="p", items=[TokenDelta(request_id="r", index=0,
                                                               token_ids=[5])]))
    at = stream.progressed_at
    assert table.stalled(after_s=1.0, now_s=at + 0.5) == {}
    assert table.stalled(after_s=1.0, now_s=at + 1.5) == {
        "d": [ResumePoint(request_id="r", next_index=1)]}
    assert table.stalled(after_s=1.0, now_s=at + 2.0) == {}  # asked 0.5 s ago
    assert table.stalled(after_s=1.0, now_s=at + 2.6) != {}


def test_streams_without_a_placement_are_asked_for_apart_on_the_attempt_they_follow() -> None:
    table = StreamTable()
    placed, unplaced = table.open("placed"), table.open("unplaced")
    table.dispatch(RequestPlaced(request_id="placed", prefill_worker_id="p",
                                 decode_worker_id="d"))
    unplaced.attempt = 1  # failed over once: its new placement not heard of yet
    at = max(placed.progressed_at, unplaced.progressed_at)
    assert table.unplaced(after_s=4.0, now_s=at + 1.5) == []
    assert table.unplaced(after_s=4.0, now_s=at + 4.5) == [
        ResumePoint(request_id="unplaced", next_index=0, attempt=1)]
    assert table.unplaced(after_s=4.0, now_s=at + 5.0) == []  # asked 0.5 s ago
    assert table.stalled(after_s=1.0, now_s=at + 5.0) == {
        "d": [ResumePoint(request_id="placed", next_index=0)]}  # never among the unplaced
