"""Which placement failures hold a request (in its model's line), for how long, and when
a delivery handed back by a stopping conductor comes again (pure decisions)."""

from __future__ import annotations

import msgspec

from services.conductor import holding
from shared.config import ConductorConfig
from shared.errors import (
    CapacityExhausted,
    KvShortage,
    ModelLoading,
    NoHealthyWorker,
    SloViolation,
)
from shared.messages import GenerateRequest, SamplingParams

CONFIG = ConductorConfig(no_worker_hold_s=5.0, kv_short_hold_s=3.0)
WAIT_S = 60.0  # the gateway's, by default


def test_a_missing_worker_and_a_kv_shortage_hold_each_for_its_own_time() -> None:
    assert holding.hold_s(NoHealthyWorker("x"), CONFIG, None, WAIT_S) == 5.0
    assert holding.hold_s(KvShortage("x"), CONFIG, None, WAIT_S) == 3.0


def test_a_model_being_loaded_holds_for_its_load_time_more() -> None:
    assert holding.hold_s(ModelLoading("x", load_s=12.0), CONFIG, None, WAIT_S) == 17.0


def test_a_kv_shortage_is_never_held_past_the_ttft_slo() -> None:
    assert holding.hold_s(KvShortage("x"), CONFIG, 0.8, WAIT_S) == 0.8


def test_by_default_room_is_waited_for_while_the_gateway_waits() -> None:
    """Until just before its gateway stops waiting, so the client hears the 429, not a
    504; a TTFT SLO still cuts it short."""
    config = ConductorConfig()
    assert config.kv_short_hold_s is None
    assert holding.hold_s(KvShortage("x"), config, None, 40.0) == 40.0 - holding.ANSWER_MARGIN_S
    assert holding.hold_s(KvShortage("x"), config, 5.0, 40.0) == 5.0
    assert holding.hold_s(KvShortage("x"), config, None, 1.0) == 0


def test_no_hold_outlasts_the_gateway_s_wait() -> None:
    """A missing worker, a model loading or a set `kv_short_hold_s` hold less when the
    gateway waits less: its client hears the 503 or 429 that says why, not a 504."""
    answer_by = 4.0 - holding.ANSWER_MARGIN_S
    for error in (NoHealthyWorker("x"), ModelLoading("x", load_s=12.0), KvShortage("x")):
        assert holding.hold_s(error, CONFIG, None, 4.0) == answer_by


def test_the_wait_is_the_request_s_own_else_the_conductor_s_setting() -> None:
    """A request says how long its gateway waits (`wait_s`, the gateway's
    `request_timeout_s`); one from a gateway that does not say gets `request_max_age_s`, so
    a conductor and a gateway run apart need not be given the same patience."""
    config = ConductorConfig(request_max_age_s=45.0)
    said = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1],
                           sampling=SamplingParams(max_tokens=1), reply_subject="s",
                           created_at_s=0.0, wait_s=300.0)
    assert holding.wait_of(said, config) == 300.0
    unsaid = msgspec.json.decode(msgspec.json.encode(said).replace(b',"wait_s":300.0', b""),
                                 type=GenerateRequest)
    assert holding.wait_of(unsaid, config) == 45.0


def test_a_missing_worker_and_no_room_wait_in_line_and_nothing_else_does() -> None:
    for error in (NoHealthyWorker("x"), ModelLoading("x", load_s=1.0), KvShortage("x")):
        assert holding.waits_in_line(error)
    for error in (CapacityExhausted("too big"), SloViolation("late", role="prefill")):
        assert not holding.waits_in_line(error)


def test_room_is_waited_for_in_the_models_line_and_each_missing_role_in_its_own() -> None:
    assert holding.line_of("m", KvShortage("x")) == "m"
    prefill = holding.line_of("m", NoHealthyWorker("x", role="prefill"))
    decode = holding.line_of("m", NoHealthyWorker("x", role="decode"))
    assert len({"m", prefill, decode}) == 3
    assert holding.line_of("m", ModelLoading("x", role="decode", load_s=1.0)) == decode
    assert holding.line_of("m", NoHealthyWorker("x")) in (prefill, decode)  # role unsaid
    assert set(holding.lines_of("m")) == {"m", prefill, decode}
    assert not {prefill, decode} & set(holding.lines_of("n"))


def test_refusals_that_do_not_clear_up_are_answered_at_once() -> None:
    for error in (CapacityExhausted("too big"), SloViolation("late", role="prefill")):
        assert holding.retry_delay_s(error, CONFIG, None, wait_s=WAIT_S, age_s=0.0,
                                     num_delivered=1) is None


def test_a_spent_hold_or_the_last_delivery_ends_it() -> None:
    shortage = KvShortage("x")
    assert holding.retry_delay_s(shortage, CONFIG, None, wait_s=WAIT_S, age_s=2.9,
                                 num_delivered=1) is None
    assert holding.retry_delay_s(shortage, CONFIG, None, wait_s=WAIT_S, age_s=0.0,
                                 num_delivered=holding.MAX_DELIVER - 1) is None
    assert holding.retry_delay_s(KvShortage("x"), CONFIG, 0.1, wait_s=WAIT_S, age_s=0.0,
                                 num_delivered=1) is None  # under the minimum retry delay


def test_a_handed_back_request_comes_back_soon_however_long_its_hold() -> None:
    """Its next delivery waits in the next conductor's line instead of polling."""
    config = ConductorConfig(kv_short_hold_s=30.0, no_worker_hold_s=30.0)
    for error in (KvShortage("x"), NoHealthyWorker("x")):
        assert holding.retry_delay_s(error, config, None, wait_s=WAIT_S, age_s=1.0,
                                     num_delivered=3) == holding.RETRY_S
